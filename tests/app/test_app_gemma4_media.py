"""A photo and a voice note in one message to the tiny Gemma 4 (tests/golden/gemma4_media)
over the real window and engine: both are dropped on the message box and kept as
attachments (the clip is not transcribed: Gemma 4 hears it), a text chat first never
loads a tower, the reply is the engine's own greedy answer for that message (image
first, then audio, then the question), both files are in the history after a restart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.api import GenerationParams, MediaInput
from engine.runtime.host import ModelHost
from tests.app.test_app_images import drop, url_mime

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
GEMMA4 = ROOT / "tests" / "golden" / "gemma4_media"
BOTH = json.loads((GEMMA4 / "expected.json").read_text())["both"]
QUESTION = BOTH["messages"][0]["content"][-1]["text"]
STEPS = len(BOTH["token_ids"])
SEND = {"max_tokens": STEPS, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma4"
    shutil.copytree(GEMMA4, folder)
    return folder


def test_gemma4_takes_a_photo_and_a_voice_note_in_one_message(
    qtbot, make_window, run_async, gemma4, shared_data, tmp_path
):
    desktop = tmp_path / "desktop"
    desktop.mkdir()
    photo, note = desktop / "cat.png", desktop / "voice-note.wav"
    shutil.copy(shared_data / "images" / "chelsea.png", photo)
    shutil.copy(shared_data / "audio" / "jfk.wav", note)
    # The engine on its own, same weights and dtype as the app loads them: what the reply must be.
    host = ModelHost()
    host.load(str(gemma4))
    want = host.generate(
        "ref",
        BOTH["messages"],
        GenerationParams(max_tokens=STEPS, ignore_eos=True),
        media=[MediaInput("image", str(photo)), MediaInput("audio", str(note))],
    ).token_ids
    host.unload()

    data = tmp_path / "data"
    window = make_window(data)
    assert run_async(window.load_model(str(gemma4)))
    info = window.bridge.model_info
    assert info.vision and info.audio

    window.store.update_conversation(window.chat.conversation_id, settings=SEND)
    window.composer.edit.setPlainText("hello")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        window.composer.send_button.click()
    assert blocker.args[1].stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"] is False

    window.new_chat()
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)
    assert drop(window.composer, url_mime(photo)).isAccepted()
    assert drop(window.composer, url_mime(note)).isAccepted()
    assert window.composer.attachments == [("image", str(photo)), ("audio", str(note))]
    window.composer.edit.setPlainText(QUESTION)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    result = blocker.args[1]
    assert window.bridge.engine_status()["tower_loaded"]
    assert result.token_ids == want
    assert result.stats.prompt_tokens == len(BOTH["prompt_ids"])
    conv = window.chat.conversation_id
    kinds = [kind for kind, _ in window.store.thread(conv)[0].attachments]
    assert kinds == ["image", "audio"]
    window.close()
    window.store.close()

    again = make_window(data)
    user = again.store.thread(conv)[0]
    assert [kind for kind, _ in user.attachments] == ["image", "audio"]
    assert all(Path(path).is_file() and Path(path).parent == data / "attachments" for _, path in user.attachments)
