"""The app under abuse, in real windows over the real engine with a tiny model."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from app.qt import Qt
from tests.faults.corpus import APP_SEND_CASES
from tests.faults.test_engine_faults import CLASS_NAME
from tests.faults.variants import VARIANTS

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _load(window, run_async, path) -> None:
    assert run_async(window.load_model(str(path)))


@pytest.mark.parametrize("name,variant,text,needle", APP_SEND_CASES, ids=[c[0] for c in APP_SEND_CASES])
def test_a_bad_send_gets_one_line_in_the_window(
    qtbot, make_window, run_async, tiny_model, tmp_path, name, variant, text, needle
):
    model = shutil.copytree(tiny_model, tmp_path / variant)
    VARIANTS[variant](model)
    window = make_window()
    _load(window, run_async, model)
    window.composer.edit.setPlainText(text)
    started = time.monotonic()
    with qtbot.wait_signal(window.chat.failed, timeout=60_000) as blocker:
        window.composer.send_button.click()
    line = blocker.args[0]
    assert "\n" not in line and needle in line, f"{name}: {line!r}"
    assert not CLASS_NAME.search(line), f"{name}: a Python class name reached the user: {line!r}"
    assert window.error_banner.isVisible() and needle in window.error_banner.text()
    assert time.monotonic() - started < 30
    # The window stays usable: the composer is ready for the next message.
    qtbot.waitUntil(lambda: window.composer.send_button.text() == "Send", timeout=10_000)
    assert window.store.thread(window.chat.conversation_id)[0].content == text.strip()  # nothing typed lost


def test_escape_cancels_a_transcription_as_the_button_does(
    qtbot, make_window, run_async, tiny_model, tmp_path, monkeypatch
):
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
