"""The model browser over a Hugging Face cache laid out as the real one, and loading from it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def make_hf_cache(root: Path, repo_id: str) -> Path:
    """models--org--name/{blobs,refs/main,snapshots/<commit>/file -> ../../blobs/<sha>}."""
    src = make_tiny_llama(root / "src")
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return root / "hub"


def test_browser_lists_cached_model_with_fit_and_loads_it(qtbot, make_window, run_async, tmp_path, monkeypatch):
    hub = make_hf_cache(tmp_path / "hf", "tiny-org/tiny-llama-chat")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    broken = tmp_path / "extra" / "broken-model"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"model_type": "llama"}')  # no weights

    window = make_window()
    browser = window.open_model_browser()
    browser.extra_dirs = [str(tmp_path / "extra")]
    with qtbot.wait_signal(browser.refreshed, timeout=30_000):
        pass  # the refresh open_model_browser started ends; run a second with extra dirs
    with qtbot.wait_signal(browser.refreshed, timeout=30_000):
        from app.tasks import spawn

        spawn(browser.refresh())
    rows = {
        browser.table.item(r, 0).text(): [browser.table.item(r, c).text() for c in range(browser.table.columnCount())]
        for r in range(browser.table.rowCount())
    }
    cached = rows["tiny-org/tiny-llama-chat"]
    assert cached[1] == "llama"
    assert cached[2].endswith("K")  # parameter count, e.g. "54K"
    assert cached[5] == "2,048"
    assert cached[6].startswith("✓ fits")
    assert rows["broken-model"][6] == "can't load"

    browser.table.selectRow(list(rows).index("tiny-org/tiny-llama-chat"))
    with qtbot.wait_signal(window.model_loaded, timeout=60_000) as blocker:
        browser.load_button.click()
    assert blocker.args[0].family == "llama"
    assert "tiny" in window.windowTitle()


def test_first_run_without_models_offers_recommended_downloads(qtbot, make_window, run_async, tmp_path, monkeypatch):
    from app.recommended import BUILT_IN, recommended_models

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    window = make_window()
    assert run_async(window.offer_models_on_first_run()) is True
    browser = window.browser
    qtbot.waitUntil(browser.isVisible)
    assert browser.tabs.currentIndex() == 1  # the Download tab
    assert "No models on this computer yet" in browser.results_title.text()
    shown = [browser.results.item(r, 0).text() for r in range(browser.results.rowCount())]
    from app.ui.memory_gauge import machine_memory

    picks = recommended_models(machine_memory())  # what fits this machine, its default first
    assert shown == [m.repo_id for m in picks]
    assert browser.results.currentRow() == 0  # the default is selected: one click to download
    assert browser.results.item(0, 1).text().startswith("≈ ")  # an approximate size
    with qtbot.wait_signal(browser.refreshed, timeout=30_000):
        pass
    browser.close()

    # Without a recommended_models.json the built-in short list is offered.
    import app.recommended

    monkeypatch.setattr(app.recommended, "resource_path", lambda name: tmp_path / "none" / name)
    assert [m.repo_id for m in recommended_models()] == [m.repo_id for m in BUILT_IN]
    assert BUILT_IN[0].repo_id == "mlx-community/Qwen3-0.6B-4bit"


def test_first_run_with_a_cached_model_stays_in_the_chat(qtbot, make_window, run_async, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(make_hf_cache(tmp_path / "hf", "org/tiny")))
    window = make_window()
    assert run_async(window.offer_models_on_first_run()) is False
    assert window.browser is None


def test_recommended_list_file_puts_its_default_first(tmp_path, monkeypatch):
    import json

    import app.recommended

    (tmp_path / "recommended_models.json").write_text(
        json.dumps(
            {
                "default": "org/b",
                "models": [
                    {"repo_id": "org/a", "approx_size_bytes": 1_000_000, "why": "small"},
                    {"repo_id": "org/b", "approx_size_bytes": 2_000_000},
                ],
            }
        )
    )
    monkeypatch.setattr(app.recommended, "resource_path", lambda name: tmp_path / name)
    picks = app.recommended.recommended_models()
    assert [(m.repo_id, m.approx_size_bytes, m.why) for m in picks] == [
        ("org/b", 2_000_000, ""),
        ("org/a", 1_000_000, "small"),
    ]


def test_base_model_without_chat_template_shows_a_notice(qtbot, make_window, run_async, shared_data, tiny_model):
    """stories260K (../shared/data/tiny_llm) is a base model: no chat template."""
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    assert not window.template_notice.isVisible()
    assert run_async(window.load_model(str(shared_data / "tiny_llm" / "stories260K.gguf")))
    assert window.template_notice.isVisible()
    assert window.template_notice.text() == ("this model has no chat template: plain text continuation")
    assert run_async(window.load_model(str(tiny_model)))
    assert not window.template_notice.isVisible()
