"""The "Split wide images" toggle over the real engine, on the tiny Gemma 3 vision checkpoint:
shown only for a model that can pan-and-scan, starting at the model's own setting, saved
with the conversation, and really changing what the engine puts in the prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from app.controllers.chat import build_params

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "vision"
SEND = {"max_tokens": 2, "ignore_eos": True, "temperature": 0.0}


def _copy(tmp_path: Path, name: str, do_pan_and_scan: bool | None = None) -> Path:
    folder = tmp_path / "models" / name
    shutil.copytree(GOLDEN / name, folder)
    if do_pan_and_scan is not None:
        pre = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps({**pre, "do_pan_and_scan": do_pan_and_scan}))
    return folder


@pytest.fixture
def panorama(tmp_path) -> Path:
    """800x300: three crops of 267x300 besides the whole."""
    path = tmp_path / "desktop" / "panorama.png"
    path.parent.mkdir()
    img = Image.new("RGB", (800, 300))
    img.putdata([(x % 256, y % 256, (x + y) % 256) for y in range(300) for x in range(800)])
    img.save(path)
    return path


def _send(qtbot, window, picture: Path):
    window.composer.add_files([str(picture)])
    window.composer.edit.setPlainText("What is in this picture?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    _, result = blocker.args
    assert result.finish_reason in ("stop", "length")
    return result


def test_toggle_follows_the_model_and_splits_the_picture(qtbot, make_window, run_async, tmp_path, panorama):
    window = make_window()
    assert not window.settings.pan_and_scan_box.isVisibleTo(window.settings)  # no model yet
    assert run_async(window.load_model(str(_copy(tmp_path, "gemma3"))))
    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings=SEND)
    window.settings.load("", SEND)
    box = window.settings.pan_and_scan_box
    assert box.isVisibleTo(window.settings) and not box.isChecked()  # the tiny model's config: off
    plain = _send(qtbot, window, panorama)

    box.setChecked(True)  # saved with the conversation, beside the other settings
    saved = window.store.conversation(conv).settings
    assert saved["pan_and_scan"] is True and saved["max_tokens"] == SEND["max_tokens"]
    split = _send(qtbot, window, panorama)
    # Three more views of 4 soft tokens, with their markers and the processor's sentence.
    assert split.stats.prompt_tokens > plain.stats.prompt_tokens + 3 * 4
    box.setChecked(False)
    assert "pan_and_scan" not in window.store.conversation(conv).settings  # back to the model's own


def test_a_model_that_splits_by_itself_starts_checked_and_others_hide_it(make_window, run_async, tmp_path):
    window = make_window()
    assert run_async(window.load_model(str(_copy(tmp_path, "gemma3", do_pan_and_scan=True))))
    window.settings.load("", {})
    assert window.settings.pan_and_scan_box.isChecked()
    assert "pan_and_scan" not in window.settings.values()
    window.settings.pan_and_scan_box.setChecked(False)
    assert window.settings.values()["pan_and_scan"] is False
    assert build_params(window.settings.values(), {}).pan_and_scan is False
    assert build_params({}, {}).pan_and_scan is None
    assert run_async(window.load_model(str(_copy(tmp_path, "qwen2_5_vl"))))
    assert not window.settings.pan_and_scan_box.isVisibleTo(window.settings)
    assert "pan_and_scan" not in window.settings.values(everything=True)
