"""iPhone/Photos pictures (HEIC) in the window over the real engine, on the tiny Gemma 3
vision checkpoint: dropped, opened by the system, pasted as data; thumbnailed upright
(Qt cannot read HEIC, so the thumbnail comes from the decoded image); sent; stored byte
for byte; and a damaged one refused in one line while the app carries on."""

from __future__ import annotations

import hashlib
import io
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.attachments import media_kind, mime_type, refusal
from app.qt import QApplication, QFileOpenEvent, QImage, QMimeData, Qt
from app.ui.composer import PICK_FILTER
from app.ui.file_open import install_file_open
from app.ui.images import image_problem, read_image
from engine.media.image import enable_heif
from tests.app.test_app_images import GEMMA, SEND, drop, open_preview, shown, url_mime

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints", "does not support raise")  # offscreen noise

# Quarter colours of the picture as it is meant to be seen (after the stored rotation).
TOP_LEFT, TOP_RIGHT, BOTTOM_LEFT, BOTTOM_RIGHT = (40, 50, 210), (220, 30, 30), (240, 240, 240), (30, 200, 40)


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    shutil.copytree(GEMMA, folder)
    return folder


def _heic_bytes() -> bytes:
    """A phone-style HEIC: pixels stored sideways (64x48) with "rotate 90° clockwise"
    (EXIF orientation 6, which pillow-heif also writes as the HEIF rotation box) and an
    embedded thumbnail, as an iPhone stores them."""
    assert enable_heif() is None
    px = np.zeros((48, 64, 3), dtype=np.uint8)
    # Stored quarters; turned clockwise they become the TOP_/BOTTOM_ colours above.
    px[:24, :32], px[:24, 32:], px[24:, :32], px[24:, 32:] = TOP_RIGHT, BOTTOM_RIGHT, TOP_LEFT, BOTTOM_LEFT
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="HEIF", exif=exif.tobytes(), quality=90, thumbnails=[32])
    return buf.getvalue()


@pytest.fixture
def heic(tmp_path) -> Path:
    path = tmp_path / "desktop" / "IMG_0001.HEIC"
    path.parent.mkdir()
    path.write_bytes(_heic_bytes())
    return path


def _assert_upright(image: QImage) -> None:
    assert not image.isNull()
    w, h = image.width(), image.height()
    for (x, y), want in [
        ((0.2, 0.2), TOP_LEFT),
        ((0.8, 0.2), TOP_RIGHT),
        ((0.2, 0.8), BOTTOM_LEFT),
        ((0.8, 0.8), BOTTOM_RIGHT),
    ]:
        c = image.pixelColor(int(x * w), int(y * h))
        assert max(abs(c.red() - want[0]), abs(c.green() - want[1]), abs(c.blue() - want[2])) < 24, (x, y)


def test_heic_counts_as_an_image_everywhere(heic):
    assert media_kind("IMG_0001.HEIC") == media_kind("x.heif") == media_kind("x.avif") == "image"
    assert refusal(heic, True) is None  # no "install a package" any more
    assert mime_type("IMG_0001.HEIC") == "image/heic" and mime_type("x.avif") == "image/avif"
    for pattern in ("*.heic", "*.HEIC", "*.heif", "*.avif", "*.JPG"):
        assert pattern in PICK_FILTER.split(";;")[1]
    assert image_problem(heic) is None
    image = read_image(heic)  # full size: 48 wide, 64 tall once turned
    assert (image.width(), image.height()) == (48, 64)
    _assert_upright(image)
    with Image.open(heic) as im:  # small enough a box: the embedded thumbnail is decoded
        assert im.draft(None, (20, 27)) is not None
    small = read_image(heic, fit=20, cover=True)
    assert min(small.width(), small.height()) == 20
    _assert_upright(small)


def test_dropped_heic_is_thumbnailed_sent_and_kept(qtbot, make_window, run_async, vision_model, heic, tmp_path):
    data = tmp_path / "data"
    window = make_window(data)
    assert run_async(window.load_model(str(vision_model)))
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)

    # A damaged copy first: one line saying what is wrong and what to do; nothing attached.
    broken = heic.with_name("IMG_0002.HEIC")
    broken.write_bytes(heic.read_bytes()[: heic.stat().st_size // 2])
    with qtbot.wait_signal(window.composer.refused) as blocker:
        drop(window.composer, url_mime(broken))
    reason = blocker.args[0]
    assert "IMG_0002.HEIC" in reason and "corrupt or truncated" in reason
    assert "\n" not in reason and reason.endswith("copy or export it again.")
    assert window.error_banner.isVisible() and window.error_banner.text() == reason
    assert window.composer.attachments == []

    event = drop(window.composer, url_mime(heic))
    assert event.isAccepted()
    assert window.composer.attachments == [("image", str(heic))]
    _assert_upright(shown(qtbot, window.composer.strip.items[0].item.picture))

    window.composer.edit.setPlainText("What is in this photo?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    reply_id, result = blocker.args
    assert result.finish_reason in ("stop", "length") and result.stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"]  # the engine decoded it and saw it

    # Kept as the original bytes (not a re-encode), under its content hash, typed image/heic.
    digest = hashlib.sha256(heic.read_bytes()).hexdigest()
    stored = (data / "attachments" / f"{digest}.heic").resolve()
    assert stored.read_bytes() == heic.read_bytes()
    conv = window.chat.conversation_id
    user = window.store.thread(conv)[0]
    assert user.attachments == [("image", str(stored))]
    with sqlite3.connect(data / "history.sqlite3") as db:
        mime = db.execute("SELECT mime FROM attachments WHERE message_id=?", (user.id,)).fetchone()[0]
    assert mime == "image/heic"
    row = window.chat_view.widgets[user.id].attachment_row
    assert row is not None and len(row.items) == 1
    _assert_upright(shown(qtbot, row.items[0].picture))
    previews = open_preview(qtbot, row.items[0])
    _assert_upright(previews[0].label.pixmap().toImage())
    for p in previews:
        p.close()


def test_heic_opened_by_the_system_or_pasted_as_data(qtbot, make_window, run_async, vision_model, heic):
    window = make_window()
    assert run_async(window.load_model(str(vision_model)))
    handler = install_file_open(window)
    try:
        assert QApplication.sendEvent(QApplication.instance(), QFileOpenEvent(str(heic)))
    finally:
        QApplication.instance().removeEventFilter(handler)
    assert window.composer.attachments == [("image", str(heic))]

    # HEIC bytes on the clipboard (no file): kept byte for byte, not re-encoded by Qt.
    mime = QMimeData()
    mime.setData("image/heic", heic.read_bytes())
    QApplication.clipboard().setMimeData(mime)
    window.composer.edit.setFocus()
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: len(window.composer.attachments) == 2, timeout=5_000)  # kept off the GUI thread
    assert len(window.composer.attachments) == 2 and window.composer.edit.toPlainText() == ""
    kind, pasted = window.composer.attachments[1]
    assert kind == "image" and pasted.endswith(".heic")
    assert Path(pasted).read_bytes() == heic.read_bytes()
    _assert_upright(shown(qtbot, window.composer.strip.items[1].item.picture))
