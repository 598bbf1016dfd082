"""The app under abuse, in real windows over the real engine with a tiny model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from app.qt import Qt

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _load(window, run_async, path) -> None:
    assert run_async(window.load_model(str(path)))


def test_a_chat_past_the_context_says_so_in_one_line(qtbot, make_window, run_async, tiny_model, tmp_path):
    small = tmp_path / "tiny-ctx64"
    shutil.copytree(tiny_model, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (small / "config.json").write_text(json.dumps(config))
    window = make_window()
    _load(window, run_async, small)
    window.composer.edit.setPlainText("word " * 400)
    with qtbot.wait_signal(window.chat.failed, timeout=60_000) as blocker:
        window.composer.send_button.click()
    line = blocker.args[0]
    assert "\n" not in line
    assert line.startswith("This chat is too long for the model's context (")
    assert "tokens of 64)" in line
    assert window.error_banner.isVisible() and "tokens of 64)" in window.error_banner.text()


def test_escape_cancels_a_transcription_as_the_button_does(qtbot, make_window, run_async, tiny_model,
                                                           tmp_path, monkeypatch):
    from app.recorder import TARGET_RATE, write_wav
    from tests.engine.media.audio_checkpoints import write_whisper_folder

    monkeypatch.delenv("MLX_DESK_WHISPER", raising=False)
    window = make_window()
    _load(window, run_async, tiny_model)
    window.set_whisper_model(str(write_whisper_folder(tmp_path / "whisper-tiny-random")))
    clip = tmp_path / "ten-minutes.wav"
    t = np.arange(TARGET_RATE * 600) / TARGET_RATE
    write_wav(clip, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))
    started = []
    window.bridge.progress.connect(lambda *a: started.append(a))
    with qtbot.wait_signal(window.transcription_finished, timeout=120_000):
        window.composer.transcribe_requested.emit(str(clip))
        qtbot.waitUntil(lambda: window.bridge.active_transcription is not None and bool(started), timeout=60_000)
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    assert "Stopped transcribing ten-minutes.wav" in window.statusBar().currentMessage()
    assert window.bridge.active_transcription is None
