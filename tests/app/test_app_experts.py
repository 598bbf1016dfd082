"""An MoE model larger than its budget runs with experts read from disk: the model
browser says so (with the expected share of full speed) instead of "too big", and the
memory gauge shows the slab and its hit rate while it answers. The model is the golden
tiny Qwen3-MoE checkpoint, loaded through the real engine."""

from __future__ import annotations

import pytest

from app.ui.model_browser import fits_badge
from tests.engine.experts.moe_folders import model_folder

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

# 165 KB of non-expert weights + half of its 49 KB of experts + the KV cache of its 256-token
# context (66 KB) fit; all of it (280 KB) does not.
BUDGET = 262_000


def test_browser_and_gauge_show_experts_from_disk(make_window, run_async, tmp_path):
    folder = model_folder(tmp_path, "qwen3_moe")
    window = make_window()
    assert run_async(window.load_model(str(folder), memory_budget=BUDGET))
    info = window.bridge.model_info
    assert info.plan.experts is not None and info.plan.experts.streamed
    badge = fits_badge(info)
    assert badge.startswith("runs with experts from disk (about ") and badge.endswith("% of full speed)")
    status = window.statusBar().currentMessage()
    assert status.startswith("Loaded qwen3_moe.") and "It runs with experts from disk" in status
    assert run_async(window.chat.send("hello there"))
    text = window.gauge.label.text()
    assert "experts" in text and "slab" in text and "hits" in text
    assert "of them held" in window.gauge.toolTip()
