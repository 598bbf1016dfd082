"""Images in the window over the real engine, on the tiny Gemma 3 vision checkpoint in
tests/golden/vision/gemma3: real drop events, paste, removal, sending, the history after a
restart, refusals by a text-only model, and no tower loaded for text-only chats."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from PIL import Image

from app.attachments import NO_VISION
from app.qt import (
    QApplication,
    QDropEvent,
    QImage,
    QMimeData,
    QPointF,
    Qt,
    QtGui,
    QUrl,
)

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
GEMMA = ROOT / "tests" / "golden" / "vision" / "gemma3"
SEND = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    shutil.copytree(GEMMA, folder)
    return folder


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    """The same checkpoint without its vision_config: a text-only Gemma 3."""
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3-text"
    shutil.copytree(GEMMA, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def photo(tmp_path) -> Path:
    """A small colourful picture somewhere outside the data dir (the user's Desktop)."""
    path = tmp_path / "desktop" / "sunset.png"
    path.parent.mkdir()
    img = Image.new("RGB", (48, 32))
    img.putdata([(x * 5, y * 8, 120) for y in range(32) for x in range(48)])
    img.save(path)
    return path


def drop(widget, mime: QMimeData) -> QDropEvent:
    """Drag-enter then drop ``mime`` on ``widget``, as Qt delivers a real drop."""
    pos = QPointF(widget.width() / 2, widget.height() / 2)
    enter = QtGui.QDragEnterEvent(
        pos, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    event = QDropEvent(pos, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, event)
    return event


def url_mime(*paths: Path) -> QMimeData:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def shown(qtbot, label) -> QImage:
    """The picture a thumbnail or preview label shows, once its background decode is in."""
    qtbot.waitUntil(lambda: not label.pixmap().isNull(), timeout=30_000)
    return label.pixmap().toImage()


def open_preview(qtbot, item):
    """Click a sent thumbnail; the preview that opens, with its picture decoded."""
    qtbot.mouseClick(item, Qt.MouseButton.LeftButton)
    previews = [w for w in QApplication.topLevelWidgets() if w.objectName() == "imagePreview" and w.isVisible()]
    assert previews
    shown(qtbot, previews[0].label)
    return previews


def _load(window, run_async, path: Path) -> None:
    assert run_async(window.load_model(str(path)))
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)


def test_drop_send_and_find_it_after_a_restart(
    qtbot, make_window, run_async, vision_model, photo, tmp_path, monkeypatch
):
    import threading

    import app.controllers.chat

    copied_in = []  # the threads that hashed and copied the attachment
    real_keep = app.controllers.chat.keep_file
    monkeypatch.setattr(
        app.controllers.chat, "keep_file", lambda *a: copied_in.append(threading.current_thread()) or real_keep(*a)
    )
    data = tmp_path / "data"
    window = make_window(data)
    _load(window, run_async, vision_model)
    assert window.bridge.model_info.vision

    event = drop(window.composer, url_mime(photo))
    assert event.isAccepted()
    assert window.composer.attachments == [("image", str(photo))]
    holder = window.composer.strip.items[0]
    assert window.composer.strip.isVisible()
    assert not shown(qtbot, holder.item.picture).isNull()  # checked and thumbnailed
    assert window.composer.checking == []

    window.composer.edit.setPlainText("What is in this picture?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    reply_id, result = blocker.args
    assert result.finish_reason in ("stop", "length") and result.stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"]  # the image really went in
    assert not window.composer.attachments and not window.composer.strip.isVisible()
    assert copied_in and threading.main_thread() not in copied_in  # never on the GUI thread

    # Kept by content hash inside the data dir, recorded with the user message.
    digest = hashlib.sha256(photo.read_bytes()).hexdigest()
    stored = (data / "attachments" / f"{digest}.png").resolve()
    assert stored.read_bytes() == photo.read_bytes()
    conv = window.chat.conversation_id
    user = window.store.thread(conv)[0]
    assert user.attachments == [("image", str(stored))]
    bubble = window.chat_view.widgets[user.id].attachment_row
    assert bubble is not None and not shown(qtbot, bubble.items[0].picture).isNull()
    assert window.store.message(reply_id).content == result.text
    window.close()
    window.store.close()
    photo.unlink()  # the user tidies their Desktop: the history keeps its copy

    again = make_window(data)
    assert again.chat.conversation_id == conv
    user = again.store.thread(conv)[0]
    assert user.attachments == [("image", str(stored))]
    row = again.chat_view.widgets[user.id].attachment_row
    assert row is not None and len(row.items) == 1
    assert not shown(qtbot, row.items[0].picture).isNull()
    with sqlite3.connect(data / "history.sqlite3") as db:
        kind, path, mime = db.execute(
            "SELECT kind, path, mime FROM attachments WHERE message_id=?", (user.id,)
        ).fetchone()
    assert (kind, path, mime) == ("image", str(stored), "image/png")

    # Clicking the thumbnail opens the larger preview.
    for p in open_preview(qtbot, row.items[0]):
        p.close()

    # An edited question keeps its picture, and the reply still sees it.
    _load(again, run_async, vision_model)
    widget = again.chat_view.widgets[user.id]
    widget.start_edit()
    widget.editor.setPlainText("Describe the colours.")
    with qtbot.wait_signal(again.chat.reply_finished, timeout=120_000):
        widget._submit_edit()
    edited = again.store.thread(conv)[0]
    assert edited.id != user.id and edited.attachments == [("image", str(stored))]
    assert again.bridge.engine_status()["tower_loaded"]


def test_drop_image_data_paste_and_remove(qtbot, make_window, run_async, vision_model, photo):
    window = make_window()
    _load(window, run_async, vision_model)
    composer = window.composer

    # A picture dragged from another app arrives as image data, not a file.
    mime = QMimeData()
    mime.setImageData(QImage(str(photo)))
    drop(composer, mime)
    qtbot.waitUntil(lambda: len(composer.attachments) == 1, timeout=5_000)  # kept off the GUI thread
    assert len(composer.attachments) == 1
    kind, kept = composer.attachments[0]
    assert kind == "image" and Path(kept).parent == (window.store.data_dir / "attachments").resolve()
    assert QImage(kept).size() == QImage(str(photo)).size()

    # Dropped on the text box, a file is attached, not typed in as its path.
    drop(composer.edit, url_mime(photo))
    assert composer.attachments[1] == ("image", str(photo))
    assert composer.edit.toPlainText() == ""

    # Ctrl/Cmd+V of a copied file.
    second = photo.with_name("copy.jpg")
    Image.open(photo).convert("RGB").save(second)
    QApplication.clipboard().setMimeData(url_mime(second))
    composer.edit.setFocus()
    qtbot.keyClick(composer.edit, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    assert [k for k, _ in composer.attachments] == ["image"] * 3
    assert composer.attachments[2] == ("image", str(second))
    assert len(composer.strip.items) == 3

    # Ctrl/Cmd+V of a copied picture (a screenshot); the same picture again is not doubled.
    QApplication.clipboard().setImage(QImage(str(second)))
    qtbot.keyClick(composer.edit, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: len(composer.attachments) == 4, timeout=5_000)  # kept off the GUI thread
    assert len(composer.attachments) == 4
    pasted = Path(composer.attachments[3][1])
    assert pasted.parent == Path(kept).parent and pasted != Path(kept)
    qtbot.keyClick(composer.edit, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    qtbot.wait(300)  # time for a second copy to be kept and attached, were it doubled
    assert len(composer.attachments) == 4 and composer.edit.toPlainText() == ""
    composer.remove_attachment(3)

    # × removes one before sending.
    qtbot.mouseClick(composer.strip.items[1].close_button, Qt.MouseButton.LeftButton)
    assert [p for _, p in composer.attachments] == [kept, str(second)]
    assert len(composer.strip.items) == 2

    # Only images and audio are attached; a document goes to the chat's documents instead.
    blob = photo.with_name("notes.bin")
    blob.write_bytes(b"hello")
    with qtbot.wait_signal(composer.refused) as blocker:
        drop(composer, url_mime(blob))
    assert "not an image, audio or video file" in blocker.args[0]
    notes = photo.with_name("notes.txt")
    notes.write_text("hello")
    with qtbot.wait_signal(composer.documents_dropped) as blocker:
        drop(composer, url_mime(notes))
    assert blocker.args == [[str(notes)]]
    assert len(composer.attachments) == 2


def test_text_only_model_refuses_images_before_anything_is_sent(
    qtbot, make_window, run_async, text_model, vision_model, photo
):
    window = make_window()
    # No model yet: the drop says what to load.
    with qtbot.wait_signal(window.composer.refused) as blocker:
        drop(window.composer, url_mime(photo))
    assert "vision model such as Gemma 3 or Qwen2.5-VL" in blocker.args[0]

    _load(window, run_async, text_model)
    assert not window.bridge.model_info.vision
    with qtbot.wait_signal(window.composer.refused) as blocker:
        drop(window.composer, url_mime(photo))
    assert blocker.args[0] == NO_VISION
    assert window.error_banner.isVisible() and window.error_banner.text() == NO_VISION
    assert window.composer.attachments == []

    # Attached while a vision model was loaded, then the model changed: refused at send.
    _load(window, run_async, vision_model)
    drop(window.composer, url_mime(photo))
    assert len(window.composer.attachments) == 1
    _load(window, run_async, text_model)
    window.composer.edit.setPlainText("and now?")
    with qtbot.wait_signal(window.composer.refused) as blocker:
        window.composer.send_button.click()
    assert blocker.args[0] == NO_VISION
    assert window.composer.edit.toPlainText() == "and now?"  # nothing lost
    assert len(window.composer.attachments) == 1
    assert window.store.thread(window.chat.conversation_id) == []  # nothing was sent
    assert not (window.store.data_dir / "attachments").exists()


def test_text_chat_on_a_vision_model_never_loads_the_tower(qtbot, make_window, run_async, vision_model):
    window = make_window()
    _load(window, run_async, vision_model)
    assert window.bridge.engine_status() == {"model_loaded": True, "tower_loaded": False}
    for text in ("hello", "and again"):
        window.composer.edit.setPlainText(text)
        with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
            window.composer.send_button.click()
        assert blocker.args[1].stats.generated_tokens >= 1
    assert window.bridge.engine_status()["tower_loaded"] is False
