"""Video in the window, over the real engine and the tiny Qwen3-VL checkpoint: a dropped
clip shows its first frame and duration, goes with the message (the reply is the
model's, its tower having watched it), is kept under attachments/ and is there after a
restart; clicking it plays it. A model that cannot watch video refuses it at the drop,
naming the families that can; a damaged clip is refused by the background check."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from app.attachments import refusal
from app.qt import Qt
from app.ui import video
from engine.api import VideoLimits
from tests.app.test_app_images import GEMMA, _load, drop, shown, url_mime

pytest.importorskip("av")

from tests.engine.media.clips import make_clip

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise
QWEN3_VL = Path(__file__).resolve().parents[1] / "golden" / "qwen3_vl" / "qwen3_vl"


@pytest.fixture(scope="module")
def video_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3-vl"
    shutil.copytree(QWEN3_VL, folder)
    return folder


@pytest.fixture
def clip(tmp_path, shared_data) -> Path:
    desktop = tmp_path / "desktop"
    desktop.mkdir()
    return make_clip(desktop / "walk.mov", shared_data / "images")


def test_drop_a_video_send_it_and_find_it_after_a_restart(
    qtbot, make_window, run_async, video_model, clip, tmp_path, monkeypatch
):
    data = tmp_path / "data"
    window = make_window(data)
    _load(window, run_async, video_model)
    assert window.bridge.model_info.video

    assert drop(window.composer, url_mime(clip)).isAccepted()
    assert window.composer.attachments == [("video", str(clip))]
    item = window.composer.strip.items[0].item
    assert not shown(qtbot, item.picture).isNull()  # the poster frame
    assert item.caption.text() == "▶ 0:02"  # 10 frames at 4 fps
    assert window.composer.checking == []

    window.composer.edit.setPlainText("What happens in this video?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    _, result = blocker.args
    assert result.finish_reason in ("stop", "length") and result.stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"]  # the frames really went in
    assert result.stats.prompt_tokens > 100  # 3 frame pairs of soft tokens and their timestamps

    digest = hashlib.sha256(clip.read_bytes()).hexdigest()
    stored = (data / "attachments" / f"{digest}.mov").resolve()
    assert stored.read_bytes() == clip.read_bytes()
    conv = window.chat.conversation_id
    user = window.store.thread(conv)[0]
    assert user.attachments == [("video", str(stored))]
    window.close()
    window.store.close()
    clip.unlink()

    again = make_window(data)
    row = again.chat_view.widgets[again.store.thread(conv)[0].id].attachment_row
    assert row is not None and len(row.items) == 1
    assert not shown(qtbot, row.items[0].picture).isNull()
    qtbot.waitUntil(lambda: row.items[0].caption.text() == "▶ 0:02", timeout=30_000)

    from app.ui import attachment_strip

    played = []
    monkeypatch.setattr(attachment_strip, "play", lambda path, parent: played.append(path))
    qtbot.mouseClick(row.items[0], Qt.MouseButton.LeftButton)
    assert played == [str(stored)]


def test_without_qtmultimedia_the_system_player_plays_it(qtbot, monkeypatch, clip):
    def no_multimedia(*_a, **_k):
        raise ImportError("No module named 'PySide6.QtMultimedia'")

    opened = []
    monkeypatch.setattr(video, "VideoPlayer", no_multimedia)
    monkeypatch.setattr(video.QDesktopServices, "openUrl", lambda url: opened.append(url.toLocalFile()))
    assert video.play(str(clip), None) is None
    assert opened == [str(clip)]


def test_a_model_without_video_refuses_the_drop_naming_the_families(
    qtbot, make_window, run_async, tmp_path_factory, clip
):
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    shutil.copytree(GEMMA, folder)
    window = make_window()
    _load(window, run_async, folder)
    with qtbot.wait_signal(window.composer.refused, timeout=10_000) as blocker:
        drop(window.composer, url_mime(clip))
    reason = blocker.args[0]
    assert "can't watch video" in reason and "qwen3_vl" in reason and "\n" not in reason
    assert window.composer.attachments == []
    assert refusal(clip, None) is not None  # no model loaded: refused too


def test_a_damaged_video_is_refused_by_the_check(qtbot, make_window, run_async, video_model, clip):
    broken = clip.with_name("broken.mp4")
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 100)
    window = make_window()
    _load(window, run_async, video_model)
    with qtbot.wait_signal(window.composer.refused, timeout=30_000) as blocker:
        drop(window.composer, url_mime(broken))
    assert "broken.mp4" in blocker.args[0] and "\n" not in blocker.args[0]
    assert window.composer.attachments == []


def test_a_long_video_gets_a_note_about_its_sampling():
    assert video.sampling_note("short.mp4", 60.0) is None
    note = video.sampling_note("talk.mp4", 15 * 60.0)
    assert "talk.mp4" in note and "15:00" in note and "768 frames" in note  # the defaults when the engine is silent
    assert video.sampling_note("short.mp4", 60.0, VideoLimits(1.0, 30)) == (
        "short.mp4 is 1:00 long: the model sees 30 frames spread evenly over it (its limit), not 1 a second."
    )


def test_the_drop_note_uses_the_loaded_models_own_frame_limit(qtbot, make_window, run_async, video_model, tmp_path):
    """The tiny Qwen3-VL's processor config takes at most 8 frames (Qwen3-VL's default is
    768): a 30 s clip, 60 frames at its 2 a second, is noted at the drop as seen in 8."""
    from tests.engine.media.clips import make_long_clip

    clip = make_long_clip(tmp_path / "walk.mp4", seconds=30)
    window = make_window()
    _load(window, run_async, video_model)
    limits = window.bridge.model_info.video_limits
    assert (limits.fps, limits.max_frames) == (2.0, 8)
    assert not window.bridge.engine_status()["tower_loaded"]  # read from its config, no weights
    with qtbot.wait_signal(window.composer.notice, timeout=30_000) as blocker:
        assert drop(window.composer, url_mime(clip)).isAccepted()
    assert (
        blocker.args[0]
        == "walk.mp4 is 0:30 long: the model sees 8 frames spread evenly over it (its limit), not 2 a second."
    )


def test_a_long_video_is_sent_sampled_and_the_status_bar_says_how(qtbot, make_window, run_async, video_model, tmp_path):
    """25 minutes: past the tiny model's 8-frame limit. It is sent, not refused; the reply
    is the model's and the engine's note (how many frames, over how long) reaches the
    status bar; a follow-up without media does not repeat it."""
    from tests.engine.media.clips import make_long_clip

    long = make_long_clip(tmp_path / "talk.mp4")
    window = make_window()
    _load(window, run_async, video_model)
    notes: list[str] = []
    window.chat.status.connect(notes.append)
    assert drop(window.composer, url_mime(long)).isAccepted()
    qtbot.waitUntil(lambda: window.composer.checking == [], timeout=30_000)
    assert window.composer.attachments == [("video", str(long))]
    window.composer.edit.setPlainText("What happens?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    assert blocker.args[1].finish_reason in ("stop", "length")
    said = [n for n in notes if "sampled to 8 frames" in n]
    assert said == [
        "A video of 25 min 00 s is longer than the model takes at 2 frames a second: "
        "it was sampled to 8 frames over its whole duration (one every 187.5 s)."
    ]
    window.composer.edit.setPlainText("And then?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000):
        window.composer.send_button.click()
    assert len([n for n in notes if "sampled to 8 frames" in n]) == 1
