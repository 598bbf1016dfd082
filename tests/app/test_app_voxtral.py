"""A voice note dropped on the tiny Voxtral (tests/golden/voxtral_tiny) over the real
engine: the window takes the clip as an attachment (no transcription), the worker hears
it through the Voxtral tower, and the reply is transformers' greedy answer for the same
question (tests/golden/media/voxtral_tiny.*). A text chat first never loads the tower."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.app.test_app_images import drop, url_mime

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
VOXTRAL = ROOT / "tests" / "golden" / "voxtral_tiny"
META = json.loads((ROOT / "tests" / "golden" / "media" / "voxtral_tiny.json").read_text())
QUESTION = META["messages"][0]["content"][1]["text"]
SEND = {"max_tokens": META["steps"], "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-voxtral"
    shutil.copytree(VOXTRAL, folder)
    return folder


def test_drop_a_voice_note_on_voxtral_and_ask_about_it(qtbot, make_window, run_async, voxtral, shared_data, tmp_path):
    with np.load(ROOT / "tests" / "golden" / "media" / "voxtral_tiny.npz") as z:
        greedy = z["greedy/ids"].tolist()
    note = tmp_path / "desktop" / "voice-note.wav"
    note.parent.mkdir()
    shutil.copy(shared_data / "audio" / "jfk.wav", note)

    window = make_window(tmp_path / "data")
    assert run_async(window.load_model(str(voxtral)))
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)
    assert window.bridge.model_info.audio

    window.composer.edit.setPlainText("hello")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        window.composer.send_button.click()
    assert blocker.args[1].stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"] is False

    window.new_chat()  # a fresh chat, so the prompt is the golden's: the clip and the question
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)
    assert drop(window.composer, url_mime(note)).isAccepted()
    assert window.composer.attachments == [("audio", str(note))]
    window.composer.edit.setPlainText(QUESTION)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    result = blocker.args[1]
    assert window.bridge.engine_status()["tower_loaded"]
    assert result.token_ids == greedy
