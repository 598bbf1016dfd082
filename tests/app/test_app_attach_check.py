"""Attaching an image never stalls the window: it is attached at once and checked (decoded
in full by the engine's opener, then thumbnailed) on a background thread, over the real
engine and the tiny Gemma 3 vision checkpoint. A damaged JPEG or PNG is refused by that
check, not at send; sending while a check runs waits for it; removing an image while
it is checked keeps it removed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import engine.media.image as engine_image
from app import tasks
from app.qt import QImageReader, Qt, QTimer
from app.ui import images
from app.ui.attachment_strip import THUMB
from app.ui.composer import WAITING_FOR_CHECK
from tests.app.test_app_images import _load, drop, shown, url_mime

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    import shutil

    from tests.app.test_app_images import GEMMA

    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    shutil.copytree(GEMMA, folder)
    return folder


@pytest.fixture
def desktop(tmp_path) -> Path:
    folder = tmp_path / "desktop"
    folder.mkdir()
    return folder


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[str, str, threading.Thread]]:
    """Where each decode ran: ("check" | "thumbnail", file name, thread). The engine's
    opener and the thumbnail reader are wrapped, and still do all the work."""
    seen: list[tuple[str, str, threading.Thread]] = []
    load_image, read_image = engine_image.load_image, images.read_image

    def checked(source, *a, **k):
        seen.append(("check", Path(source).name, threading.current_thread()))
        return load_image(source, *a, **k)

    def thumbed(path, *a, **k):
        seen.append(("thumbnail", Path(path).name, threading.current_thread()))
        return read_image(path, *a, **k)

    monkeypatch.setattr(engine_image, "load_image", checked)
    monkeypatch.setattr(images, "read_image", thumbed)
    return seen


def _noise_picture(path: Path, size=(160, 120)) -> Path:
    """A picture whose compressed data runs to the end of the file (noise), so cutting
    the file short cuts into the pixels, not into trailing metadata."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _big_photo(path: Path) -> Path:
    """A 6000x4000 JPEG (24 megapixels, as a camera makes them)."""
    ramp = Image.linear_gradient("L").resize((6000, 4000))
    Image.merge(
        "RGB", (ramp, ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT), ramp.transpose(Image.Transpose.FLIP_TOP_BOTTOM))
    ).save(path, quality=85)
    return path


def _idle(qtbot) -> None:
    """Every background task (checks whose result is dropped included) has come back."""
    qtbot.waitUntil(lambda: tasks.pending() == 0, timeout=30_000)


@pytest.mark.parametrize("name", ["truncated.jpg", "truncated.png"])
def test_damaged_jpeg_or_png_is_refused_by_the_check(
    qtbot, make_window, run_async, vision_model, desktop, decodes, name
):
    window = make_window()
    _load(window, run_async, vision_model)
    broken = _truncated(_noise_picture(desktop / name))
    assert QImageReader(str(broken)).canRead()  # the header alone looks fine

    with qtbot.wait_signal(window.composer.refused, timeout=30_000) as blocker:
        drop(window.composer, url_mime(broken))
        assert window.composer.attachments == [("image", str(broken))]  # attached at once
        assert window.composer.checking == [str(broken)]
    reason = blocker.args[0]
    assert name in reason and "corrupt or truncated" in reason and "\n" not in reason
    assert window.error_banner.isVisible() and window.error_banner.text() == reason
    assert window.composer.attachments == [] and window.composer.strip.items == []
    assert [(what, n) for what, n, _ in decodes] == [("check", name)]  # no thumbnail of it
    assert decodes[0][2] is not threading.main_thread()


def test_big_photo_is_checked_and_thumbnailed_off_the_gui_thread(
    qtbot, make_window, run_async, vision_model, desktop, decodes
):
    window = make_window()
    _load(window, run_async, vision_model)
    photo = _big_photo(desktop / "DSC_0001.JPG")
    composer = window.composer
    gaps, last = [0.0], [time.perf_counter()]

    def tick():
        now = time.perf_counter()
        gaps[0] = max(gaps[0], now - last[0])
        last[0] = now

    timer = QTimer()
    timer.setInterval(5)
    timer.timeout.connect(tick)
    last[0] = time.perf_counter()
    timer.start()
    drop(composer, url_mime(photo))
    assert composer.attachments == [("image", str(photo))]  # there before any decoding
    assert composer.strip.thumbnail_pending(str(photo))  # a spinner holds its place
    thumb = shown(qtbot, composer.strip.items[0].item.picture)
    timer.stop()
    print(f"\nGUI thread longest stall while a 6000x4000 JPEG was attached: {gaps[0] * 1000:.1f} ms")

    assert composer.checking == [] and composer.attachments == [("image", str(photo))]
    ratio = composer.devicePixelRatioF()
    assert (thumb.width(), thumb.height()) == (round(THUMB * ratio),) * 2
    assert [what for what, _, _ in decodes] == ["check", "thumbnail"]
    main = threading.main_thread()
    assert all(thread is not main for _, _, thread in decodes)


def test_send_during_the_check_waits_for_it_then_goes(qtbot, make_window, run_async, vision_model, desktop):
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer
    photo = _noise_picture(desktop / "cat.png")
    drop(composer, url_mime(photo))
    composer.edit.setPlainText("What is this?")
    sent: list[str] = []
    composer.send_requested.connect(lambda text, _att: sent.append(text))
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000):
        with qtbot.wait_signal(composer.notice) as notice:
            composer.send_button.click()
        assert notice.args[0] == WAITING_FOR_CHECK
        assert sent == [] and composer.checking == [str(photo)]  # held, not sent
        assert composer.edit.toPlainText() == "What is this?"
    assert sent == ["What is this?"] and composer.edit.toPlainText() == ""
    user = window.store.thread(window.chat.conversation_id)[0]
    assert user.content == "What is this?" and len(user.attachments) == 1
    assert window.bridge.engine_status()["tower_loaded"]  # the picture went with it


def test_send_during_a_failing_check_keeps_the_message(qtbot, make_window, run_async, vision_model, desktop):
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer
    broken = _truncated(_noise_picture(desktop / "broken.jpg"))
    drop(composer, url_mime(broken))
    composer.edit.setPlainText("and this one?")
    with qtbot.wait_signal(composer.refused, timeout=30_000) as blocker:
        composer.send_button.click()
        assert composer.send_waiting
    assert "broken.jpg" in blocker.args[0] and not composer.send_waiting
    assert composer.edit.toPlainText() == "and this one?" and composer.attachments == []
    _idle(qtbot)
    assert window.store.thread(window.chat.conversation_id) == []  # nothing went


def test_escape_cancels_a_send_waiting_for_the_check(qtbot, make_window, run_async, vision_model, desktop):
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer
    photo = _noise_picture(desktop / "dog.png")
    drop(composer, url_mime(photo))
    composer.edit.setPlainText("wait")
    composer.send_button.click()
    assert composer.send_waiting
    qtbot.keyClick(composer.edit, Qt.Key.Key_Escape)
    assert not composer.send_waiting
    shown(qtbot, composer.strip.items[0].item.picture)
    _idle(qtbot)
    assert composer.edit.toPlainText() == "wait" and composer.attachments == [("image", str(photo))]
    assert window.store.thread(window.chat.conversation_id) == []


def test_removed_during_the_check_stays_removed(qtbot, make_window, run_async, vision_model, desktop, decodes):
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer
    _idle(qtbot)
    good = _noise_picture(desktop / "good.png")
    broken = _truncated(_noise_picture(desktop / "broken.png"))

    with qtbot.assert_not_emitted(composer.refused):
        drop(composer, url_mime(good, broken))
        assert composer.checking == [str(good), str(broken)]
        qtbot.mouseClick(composer.strip.items[1].close_button, Qt.MouseButton.LeftButton)
        composer.remove_attachment(0)
        assert composer.attachments == [] and composer.checking == []
        _idle(qtbot)
    assert {n for what, n, _ in decodes if what == "check"} == {"good.png", "broken.png"}  # ran
    assert composer.attachments == [] and composer.strip.items == []  # and was dropped

    # Removed and attached again while the first check runs: one attachment, one thumbnail.
    drop(composer, url_mime(good))
    composer.remove_attachment(0)
    drop(composer, url_mime(good))
    drop(composer, url_mime(good))  # a duplicate is ignored, as ever
    assert composer.attachments == [("image", str(good))]
    shown(qtbot, composer.strip.items[0].item.picture)
    _idle(qtbot)
    assert composer.attachments == [("image", str(good))] and len(composer.strip.items) == 1
    assert composer.checking == []


def test_a_message_put_back_is_checked_again(qtbot, make_window, run_async, vision_model, desktop):
    """A send the window refused hands the message back: its pictures return to the strip,
    each checked and thumbnailed again in the background."""
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer
    photo = _noise_picture(desktop / "back.png")
    composer.restore("again", [("image", str(photo))])
    assert composer.checking == [str(photo)] and composer.strip.thumbnail_pending(str(photo))
    shown(qtbot, composer.strip.items[0].item.picture)
    assert composer.checking == [] and composer.edit.toPlainText() == "again"


def test_the_check_never_brings_in_mlx(desktop):
    """The check runs in the app's process on the engine's opener, which is Pillow only."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    photo = _noise_picture(desktop / "p.jpg")
    heic = desktop / "p.heic"
    engine_image.enable_heif()
    Image.open(photo).save(heic, format="HEIF")
    script = f"""
import sys
from app.qt import QApplication
app = QApplication([])
from app.ui.images import check_image
for path in ({str(photo)!r}, {str(heic)!r}):
    result = check_image(path, 64)
    assert result.problem is None and not result.thumb.isNull(), result
print(",".join(m for m in sys.modules if m == "mlx" or m.startswith("mlx.")))
"""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
