"""Thumbnails of attached images and chips of audio clips.

``AttachmentStrip`` sits above the composer's text box (each item has a × to remove it
before sending); ``AttachmentRow`` shows a sent message's attachments in its bubble,
where clicking an image opens ``ImagePreview``. Images are read by Qt (PNG, JPEG, WebP,
GIF, BMP), with Pillow as the fallback for what Qt lacks (HEIC/HEIF via pillow-heif, AVIF),
through the engine's own opener so a photo is turned upright exactly as the model sees it.
"""

from __future__ import annotations

from pathlib import Path

from app.qt import (
    QApplication,
    QDialog,
    QFrame,
    QHBoxLayout,
    QImage,
    QImageReader,
    QLabel,
    QPainter,
    QPainterPath,
    QPixmap,
    QRectF,
    QScrollArea,
    QSize,
    Qt,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)

THUMB = 64  # composer strip
BUBBLE_THUMB = 120  # sent messages


def read_image(path: str | Path, fit: int | None = None, cover: bool = False) -> QImage:
    """The image upright (EXIF), scaled down to fit in (or, with ``cover``, to cover) a
    ``fit`` px square when given; a null QImage when neither Qt nor Pillow can read it.
    Qt decodes at the reduced size, so a phone photo's thumbnail stays cheap."""
    mode = (Qt.AspectRatioMode.KeepAspectRatioByExpanding if cover
            else Qt.AspectRatioMode.KeepAspectRatio)
    reader = QImageReader(str(path))
    reader.setAutoTransform(True)
    if fit and reader.canRead():
        size = reader.size()  # the box is square, so the EXIF rotation does not matter
        if size.isValid() and _side(size.width(), size.height(), cover) > fit:
            reader.setScaledSize(size.scaled(QSize(fit, fit), mode))
    image = reader.read() if reader.canRead() else QImage()
    if image.isNull():
        image = _read_with_pillow(path, fit, cover)
    if fit and not image.isNull() and _side(image.width(), image.height(), cover) > fit:
        image = image.scaled(fit, fit, mode, Qt.TransformationMode.SmoothTransformation)
    return image


def _side(width: int, height: int, cover: bool) -> int:
    return min(width, height) if cover else max(width, height)


def _read_with_pillow(path: str | Path, fit: int | None = None, cover: bool = False) -> QImage:
    """Decode with Pillow (no Qt plug-in for HEIC/AVIF); alpha is kept for the picture.
    With ``fit``, a HEIC's embedded thumbnail is decoded instead when it is big enough."""
    try:
        from PIL import Image

        from engine.media.image import enable_heif, upright  # Pillow only: no mlx

        enable_heif()
        with Image.open(path) as im:
            if fit:
                w, h = im.size
                scale = fit / max(1, _side(w, h, cover))
                if scale < 1:
                    im.draft(None, (max(1, round(w * scale)), max(1, round(h * scale))))
            im = upright(im)
            has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None
            im = im.convert("RGBA" if has_alpha else "RGB")
    except Exception:  # noqa: BLE001 - unreadable: the caller shows a placeholder
        return QImage()
    fmt = QImage.Format.Format_RGBA8888 if im.mode == "RGBA" else QImage.Format.Format_RGB888
    data = im.tobytes()
    return QImage(data, im.width, im.height, len(im.mode) * im.width, fmt).copy()  # owns its pixels


def image_problem(path: str | Path) -> str | None:
    """Why the image at ``path`` cannot be sent, in one line (None: nothing found).

    Formats only Pillow reads (HEIC, HEIF, AVIF) are decoded here, through the engine's
    opener, so a damaged photo is refused when attached, with the engine's own words,
    not after the message was sent. Formats Qt reads are left to their thumbnail."""
    from app.attachments import PILLOW_ONLY_EXT

    if Path(path).suffix.lower() not in PILLOW_ONLY_EXT and QImageReader(str(path)).canRead():
        return None
    from engine.errors import MediaError
    from engine.media.image import load_image

    try:
        load_image(path)
    except MediaError as exc:
        return str(exc)
    return None


def thumbnail(path: str | Path, size: int, ratio: float = 1.0, radius: int = 8) -> QPixmap:
    """A square-cropped thumbnail with rounded corners (``size`` logical px), crisp at
    the screen's pixel ``ratio``."""
    px = max(1, round(size * ratio))
    image = read_image(path, fit=px, cover=True)
    if image.isNull():
        return QPixmap()
    if min(image.width(), image.height()) < px:  # a small picture: blow it up to the square
        image = image.scaled(px, px, Qt.AspectRatioMode.KeepAspectRatioByExpanding,
                             Qt.TransformationMode.SmoothTransformation)
    x, y = (image.width() - px) // 2, (image.height() - px) // 2
    square = image.copy(x, y, px, px)
    pixmap = QPixmap(px, px)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    clip = QPainterPath()
    clip.addRoundedRect(QRectF(0, 0, px, px), radius * ratio, radius * ratio)
    painter.setClipPath(clip)
    painter.drawImage(0, 0, square)
    painter.end()
    pixmap.setDevicePixelRatio(ratio)
    return pixmap


def _ratio(widget: QWidget) -> float:
    return widget.devicePixelRatioF() if widget is not None else 1.0


class _Item(QFrame):
    """One attachment: an image thumbnail, or an audio chip with the file's name."""

    clicked = Signal()

    def __init__(self, kind: str, path: str, size: int, parent: QWidget | None = None):
        super().__init__(parent)
        self.kind, self.path = kind, path
        self.setObjectName("attachmentItem")
        self.setToolTip(Path(path).name)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.picture = QLabel(objectName="attachmentThumb")
        self.picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
        if kind == "image":
            pixmap = thumbnail(path, size, _ratio(parent) if parent else 1.0,
                               radius=10 if size > THUMB else 8)
            if pixmap.isNull():
                self.picture.setText("?")
            else:
                self.picture.setPixmap(pixmap)
            self.picture.setFixedSize(size, size)
            self.setCursor(Qt.CursorShape.PointingHandCursor)
        else:
            self.picture.setObjectName("audioChip")
            self.picture.setText(f"♪  {_short(Path(path).name)}")
            self.picture.setFixedHeight(min(size, 36))
        layout.addWidget(self.picture)

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.button() == Qt.MouseButton.LeftButton and self.rect().contains(event.position().toPoint()):
            emit(self.clicked)
        super().mouseReleaseEvent(event)


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else name[: limit - 9] + "…" + name[-8:]


class AttachmentStrip(QWidget):
    """The composer's pending attachments; × removes one (``removed`` gives its index)."""

    removed = Signal(int)
    preview_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attachmentStrip")
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(0, 2, 0, 4)
        self.row.setSpacing(8)
        self.row.addStretch(1)
        self.items: list[QWidget] = []
        self.setVisible(False)

    def set_items(self, attachments: list[tuple[str, str]]) -> None:
        for w in self.items:
            self.row.removeWidget(w)
            w.deleteLater()
        self.items = []
        for i, (kind, path) in enumerate(attachments):
            holder = QWidget(self)
            holder.setObjectName("attachmentHolder")
            item = _Item(kind, path, THUMB, holder)
            item.clicked.connect(lambda p=path, k=kind: k == "image" and emit(self.preview_requested, p))
            close = QToolButton(holder, objectName="removeAttachment", text="×")
            close.setToolTip(f"Remove {Path(path).name}")
            close.setCursor(Qt.CursorShape.PointingHandCursor)
            close.setFixedSize(20, 20)
            close.clicked.connect(lambda _=False, index=i: emit(self.removed, index))
            lay = QHBoxLayout(holder)
            lay.setContentsMargins(0, 6, 6, 0)  # room for the × over the top-right corner
            lay.addWidget(item)
            holder.adjustSize()
            close.move(holder.sizeHint().width() - 20, 0)
            close.raise_()
            holder.close_button = close
            holder.item = item
            self.row.insertWidget(i, holder)
            self.items.append(holder)
        self.setVisible(bool(attachments))


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
            row.addWidget(item)
            self.items.append(item)


class ImagePreview(QDialog):
    """The image at up to 80% of the screen, closed with Esc or a click."""

    def __init__(self, path: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("imagePreview")
        self.setWindowTitle(Path(path).name)
        screen = (parent.screen() if parent is not None else QApplication.primaryScreen())
        area = screen.availableGeometry() if screen is not None else None
        fit = int(min(area.width(), area.height()) * 0.8) if area is not None else 900
        image = read_image(path, fit=fit)
        self.label = QLabel(objectName="previewImage")
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        if image.isNull():
            self.label.setText(f"{Path(path).name} cannot be shown (the file is missing or unreadable).")
        else:
            self.label.setPixmap(QPixmap.fromImage(image))
        scroll = QScrollArea()
        scroll.setWidget(self.label)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(scroll)
        if not image.isNull():
            self.resize(image.width() + 20, image.height() + 20)

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.accept()

    @staticmethod
    def open_for(path: str, parent: QWidget | None) -> "ImagePreview":
        dialog = ImagePreview(path, parent.window() if parent is not None else None)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog
