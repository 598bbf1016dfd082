"""The memory gauge projects sliding-window models right: their windows stop growing.

The models are the tiny llama with Mistral's sliding window switched on (every layer,
or one of two through ``layer_types``), loaded through the real engine.
"""

from __future__ import annotations

import json
import shutil

import pytest

from app.ui.model_browser import fits_badge

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

WINDOW = 16


@pytest.fixture
def windowed_model(tiny_model, tmp_path):
    def make(layer_types: list[str] | None):
        folder = tmp_path / ("mixed" if layer_types else "sliding")
        shutil.copytree(tiny_model, folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
        if layer_types:
            config["layer_types"] = layer_types
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return make


def load_with_budget(window, run_async, path, kv_tokens: int | None = None, budget: int | None = None):
    assert run_async(window.load_model(str(path)))
    plan = window.bridge.model_info.plan
    if budget is None:
        budget = plan.weights_bytes + plan.kv_bytes(kv_tokens)
    assert run_async(window.load_model(str(path), memory_budget=budget))
    return window.bridge.model_info.plan


def test_projection_counts_a_window_once(make_window, run_async, windowed_model):
    window = make_window()
    path = windowed_model(["sliding_attention", "full_attention"])
    plan = load_with_budget(window, run_async, path, kv_tokens=1000)
    assert plan.kv_windows and plan.kv_windows[0].tokens == WINDOW and plan.kv_bytes_per_token > 0
    gauge = window.gauge
    context = window.chat.context_tokens()

    window.settings.inputs["max_tokens"].setValue(1000 - context)
    assert gauge.projected_need() == plan.weights_bytes + plan.kv_bytes(1000) == plan.budget_bytes
    assert gauge.level == "amber"  # right at the budget, not over it
    # Ten tokens more are over, though the full-attention layers alone would still fit:
    # the window's share is part of the projection.
    window.settings.inputs["max_tokens"].setValue(1010 - context)
    assert plan.weights_bytes + plan.kv_bytes_per_token * 1010 < plan.budget_bytes
    assert gauge.level == "red" and "may not fit in memory" in window.error_banner.text()
    assert "sliding windows" in gauge.toolTip()


def test_all_sliding_model_never_outgrows_its_windows(make_window, run_async, windowed_model):
    window = make_window()
    path = windowed_model(None)
    assert run_async(window.load_model(str(path)))
    first = window.bridge.model_info.plan
    plan = load_with_budget(window, run_async, path, budget=2 * first.weights_bytes)
    assert plan.kv_bytes_per_token == 0 and not plan.kv_limits_context
    assert fits_badge(window.bridge.model_info) == f"✓ fits ({window.bridge.model_info.context_length:,} tok)"

    gauge = window.gauge
    window.settings.inputs["max_tokens"].setValue(2000)
    assert gauge.projected_need() == plan.weights_bytes + plan.kv_window_bytes
    assert gauge.level == "ok" and gauge.warning == ""
    assert gauge.bar.projected == gauge.projected_need()  # the projection is drawn, not switched off
