"""Thumbnails of attached images, posters of videos (with their duration) and chips of
audio clips.

``AttachmentStrip`` sits above the composer's text box (each item has a × to remove it
before sending); ``AttachmentRow`` shows a sent message's attachments in its bubble,
where clicking an image opens ``ImagePreview`` and clicking a video plays it. Pictures are decoded off the GUI thread
(app.ui.images): an image's slot shows a spinner until its thumbnail is ready.
"""

from __future__ import annotations

from pathlib import Path

from app.ops import Op
from app.qt import (
    QApplication,
    QDialog,
    QFrame,
    QHBoxLayout,
    QImage,
    QLabel,
    QPixmap,
    QScrollArea,
    QSize,
    Qt,
    QTimer,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.ui.images import read_image, thumbnail_image
from app.ui.video import VideoCheck, check_video, duration_text, play

THUMB = 64  # composer strip
BUBBLE_THUMB = 120  # sent messages


def _ratio(widget: QWidget) -> float:
    return widget.devicePixelRatioF() if widget is not None else 1.0


SPINNER = "◐◓◑◒"
SPIN_MS = 150


class _Item(QFrame):
    """One attachment: an image thumbnail, a video's poster frame with its duration, or an
    audio chip with the file's name.

    A picture starts as a spinner; ``set_thumbnail`` puts it in (``set_caption`` a video's
    duration). With ``load`` the item reads its own thumbnail in the background (a sent
    message's bubble); without, whoever attached it delivers one (the composer, after
    checking the file)."""

    clicked = Signal()

    def __init__(self, kind: str, path: str, size: int, parent: QWidget | None = None, load: bool = True):
        super().__init__(parent)
        self.kind, self.path, self.size = kind, path, size
        self.pending = False
        self.setObjectName("attachmentItem")
        self.setToolTip(Path(path).name)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.picture = QLabel(objectName="attachmentThumb")
        self.picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.caption: QLabel | None = None
        if kind == "video":  # the duration over the poster's lower edge
            self.caption = QLabel("▶", self.picture, objectName="videoDuration")
            self.caption.setGeometry(4, size - 18, size - 8, 16)
        if kind in ("image", "video"):
            self.picture.setFixedSize(size, size)
            self.setCursor(Qt.CursorShape.PointingHandCursor)
            self._spin = QTimer(self)
            self._spin.setInterval(SPIN_MS)
            self._spin.timeout.connect(self._turn)
            self._frame = 0
            self.pending = True
            self.picture.setProperty("pending", True)  # a grey tile (style.qss) until the picture comes
            self.picture.setText(SPINNER[0])
            self._spin.start()
            if load and kind == "image":
                Op(thumbnail_image, path, size, self.ratio(), self.radius).success(self.set_thumbnail).run(self)
            elif load:
                Op(check_video, path, size, self.ratio(), self.radius).success(self.set_video).run(self)
        else:
            self.picture.setObjectName("audioChip")
            self.picture.setText(f"♪  {_short(Path(path).name)}")
            self.picture.setFixedHeight(min(size, 36))
        layout.addWidget(self.picture)

    @property
    def radius(self) -> int:
        return 10 if self.size > THUMB else 8

    def ratio(self) -> float:
        return _ratio(self.parentWidget())

    def set_thumbnail(self, image: QImage) -> None:
        """The picture is ready (a null image: unreadable, shown as "?")."""
        self.pending = False
        self._spin.stop()
        self.picture.setProperty("pending", False)
        self.picture.style().unpolish(self.picture)
        self.picture.style().polish(self.picture)
        if image.isNull():
            self.picture.setText("?")
        else:
            self.picture.setPixmap(QPixmap.fromImage(image))

    def set_caption(self, text: str) -> None:
        if self.caption is not None:
            self.caption.setText(text)
            self.caption.raise_()

    def set_video(self, check: VideoCheck) -> None:
        self.set_thumbnail(check.thumb)
        if check.problem is None:
            self.set_caption(f"▶ {duration_text(check.seconds)}")

    def _turn(self) -> None:
        self._frame = (self._frame + 1) % len(SPINNER)
        self.picture.setText(SPINNER[self._frame])

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.button() == Qt.MouseButton.LeftButton and self.rect().contains(event.position().toPoint()):
            emit(self.clicked)
        super().mouseReleaseEvent(event)


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else name[: limit - 9] + "…" + name[-8:]


class AttachmentStrip(QWidget):
    """The composer's pending attachments; × removes one (``removed`` gives its index).
    Image thumbnails come from the composer (``set_thumbnail``) once it has checked them;
    an item stays, with its picture, while the list around it changes."""

    removed = Signal(int)
    preview_requested = Signal(str)
    play_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attachmentStrip")
        # However many are attached, the strip keeps the composer's width and scrolls
        # sideways: the window never grows past the screen (Send stays in reach).
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.scroll = QScrollArea(objectName="attachmentScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.body = QWidget(objectName="attachmentBody")
        self.scroll.setWidget(self.body)
        outer.addWidget(self.scroll)
        self.row = QHBoxLayout(self.body)
        self.row.setContentsMargins(0, 2, 0, 4)
        self.row.setSpacing(8)
        self.row.addStretch(1)
        self.items: list[QWidget] = []
        self.setVisible(False)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        """As tall as a row of thumbnails and its scroll bar; as wide as the composer lets it."""
        bar = self.scroll.horizontalScrollBar().sizeHint().height()
        return QSize(THUMB, self.body.sizeHint().height() + bar)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(THUMB, self.sizeHint().height())

    def set_items(self, attachments: list[tuple[str, str]]) -> None:
        kept = {(h.item.kind, h.item.path): h for h in self.items}
        self.items = []
        for kind, path in attachments:
            holder = kept.pop((kind, path), None) or self._holder(kind, path)
            self.row.removeWidget(holder)
            self.row.insertWidget(len(self.items), holder)
            self.items.append(holder)
        for holder in kept.values():
            self.row.removeWidget(holder)
            holder.deleteLater()
        self.setVisible(bool(attachments))

    def set_thumbnail(self, path: str, image: QImage, caption: str | None = None) -> None:
        for holder in self.items:
            if holder.item.kind in ("image", "video") and holder.item.path == path:
                holder.item.set_thumbnail(image)
                if caption is not None:
                    holder.item.set_caption(caption)

    def thumbnail_pending(self, path: str) -> bool:
        return any(h.item.path == path and h.item.pending for h in self.items)

    def _holder(self, kind: str, path: str) -> QWidget:
        holder = QWidget(self.body)
        holder.setObjectName("attachmentHolder")
        item = _Item(kind, path, THUMB, holder, load=False)
        item.clicked.connect(lambda p=path, k=kind: k == "image" and emit(self.preview_requested, p))
        item.clicked.connect(lambda p=path, k=kind: k == "video" and emit(self.play_requested, p))
        close = QToolButton(holder, objectName="removeAttachment", text="×")
        close.setToolTip(f"Remove {Path(path).name}")
        close.setCursor(Qt.CursorShape.PointingHandCursor)
        close.setFixedSize(20, 20)
        close.clicked.connect(lambda _=False, h=holder: h in self.items and emit(self.removed, self.items.index(h)))
        lay = QHBoxLayout(holder)
        lay.setContentsMargins(0, 6, 6, 0)  # room for the × over the top-right corner
        lay.addWidget(item)
        holder.adjustSize()
        close.move(holder.sizeHint().width() - 20, 0)
        close.raise_()
        holder.close_button = close
        holder.item = item
        return holder


class AttachmentRow(QWidget):
    """A sent message's attachments, in its bubble; clicking an image previews it."""

    def __init__(self, attachments: list[tuple[str, str]], parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attachmentRow")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(6)
        row.addStretch(1)
        self.items: list[_Item] = []
        for kind, path in attachments:
            item = _Item(kind, path, BUBBLE_THUMB, self)
            if kind == "image":
                item.clicked.connect(lambda p=path: ImagePreview.open_for(p, self))
            elif kind == "video":
                item.clicked.connect(lambda p=path: play(p, self))
            row.addWidget(item)
            self.items.append(item)


class ImagePreview(QDialog):
    """The image at up to 80% of the screen, closed with Esc or a click. It opens at
    once, saying "Loading…" while the picture is decoded in the background."""

    def __init__(self, path: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("imagePreview")
        self.setWindowTitle(Path(path).name)
        self.path = path
        screen = parent.screen() if parent is not None else QApplication.primaryScreen()
        area = screen.availableGeometry() if screen is not None else None
        fit = int(min(area.width(), area.height()) * 0.8) if area is not None else 900
        self.label = QLabel("Loading…", objectName="previewImage")
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        scroll = QScrollArea()
        scroll.setWidget(self.label)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(scroll)
        self.resize(320, 240)
        Op(read_image, path, fit).success(self._show).run(self)

    def _show(self, image: QImage) -> None:
        if image.isNull():
            self.label.setText(f"{Path(self.path).name} cannot be shown (the file is missing or unreadable).")
            return
        self.label.setPixmap(QPixmap.fromImage(image))
        self.resize(image.width() + 20, image.height() + 20)

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.accept()

    @staticmethod
    def open_for(path: str, parent: QWidget | None) -> ImagePreview:
        dialog = ImagePreview(path, parent.window() if parent is not None else None)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog
