"""Reading image files for the window, away from the GUI thread.

Images are read by Qt (PNG, JPEG, WebP, GIF, BMP), with Pillow as the fallback for what
Qt lacks (HEIC/HEIF via pillow-heif, AVIF), through the engine's own opener so a photo is
turned upright exactly as the model sees it. Decoding a phone photo takes a noticeable
fraction of a second (a HEIC longer), so none of it runs on the GUI thread: everything
here makes QImages, which Qt lets any thread build and paint, and an ``app.ops.Op`` runs
such work on a helper thread and hands the result back to the GUI thread. The engine's
opener is Pillow only: importing it never brings in mlx.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from app.qt import (
    QImage,
    QImageReader,
    QPainter,
    QPainterPath,
    QRectF,
    QSize,
    Qt,
)

# Full-size decodes at once: a dozen photos dropped together wait their turn instead of
# holding a dozen 12-megapixel bitmaps (and all the cores) at the same moment.
DECODERS = 2
_decoders = threading.BoundedSemaphore(DECODERS)


def read_image(path: str | Path, fit: int | None = None, cover: bool = False) -> QImage:
    """The image upright (EXIF), scaled down to fit in (or, with ``cover``, to cover) a
    ``fit`` px square when given; a null QImage when neither Qt nor Pillow can read it.
    Qt decodes at the reduced size (a JPEG through libjpeg's scaled decode), and Pillow
    in draft mode, so a phone photo's thumbnail stays cheap. Any thread may call it."""
    mode = Qt.AspectRatioMode.KeepAspectRatioByExpanding if cover else Qt.AspectRatioMode.KeepAspectRatio
    reader = QImageReader(str(path))
    reader.setAutoTransform(True)
    if _too_many_pixels(reader):  # refused when attached; never decoded for a thumbnail
        return QImage()
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


def _too_many_pixels(reader: QImageReader) -> bool:
    from engine.media.image_limits import MAX_PIXELS  # Pillow only: no mlx

    size = reader.size()
    return size.isValid() and size.width() * size.height() > MAX_PIXELS


def _side(width: int, height: int, cover: bool) -> int:
    return min(width, height) if cover else max(width, height)


def _read_with_pillow(path: str | Path, fit: int | None = None, cover: bool = False) -> QImage:
    """Decode with Pillow (no Qt plug-in for HEIC/AVIF); alpha is kept for the picture.
    With ``fit``, a JPEG is decoded at a reduced scale and a HEIC's embedded thumbnail
    is decoded instead when it is big enough (Pillow's draft mode)."""
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
    return _to_qimage(im)


def _to_qimage(im) -> QImage:
    """An RGB or RGBA Pillow image as a QImage that owns its pixels."""
    fmt = QImage.Format.Format_RGBA8888 if im.mode == "RGBA" else QImage.Format.Format_RGB888
    data = im.tobytes()
    return QImage(data, im.width, im.height, len(im.mode) * im.width, fmt).copy()  # owns its pixels


def image_problem(path: str | Path) -> str | None:
    """Why the image at ``path`` cannot be sent, in the engine's one line (None: it decodes).

    The whole file is decoded by the engine's own opener, whatever the format, so a
    truncated JPEG or PNG (whose header alone reads fine) is refused when attached, with
    the words the engine would use, not after the message was sent. Slow for a large
    photo: call it off the GUI thread (``check_image`` does)."""
    return _decode(path)[0]


def _decode(path: str | Path, keep_fit: int | None = None):
    """(problem, None) or (None, the decoded picture: shrunk to cover ``keep_fit`` px
    when given, else None)."""
    from engine.errors import MediaError
    from engine.media.image import load_image

    with _decoders:
        try:
            im = load_image(path)
        except MediaError as exc:
            return str(exc), None
        if not keep_fit:
            return None, None
        scale = keep_fit / max(1, min(im.size))
        if scale < 1:  # to the thumbnail's size while the full bitmap is at hand
            im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), reducing_gap=3.0)
        return None, _to_qimage(im)


def thumbnail_image(path: str | Path, size: int, ratio: float = 1.0, radius: int = 8) -> QImage:
    """A square-cropped thumbnail with rounded corners (``size`` logical px), crisp at
    the screen's pixel ``ratio`` (carried as the image's device pixel ratio); a null
    image when the file cannot be read. Any thread may call it."""
    px = max(1, round(size * ratio))
    with _decoders:
        image = read_image(path, fit=px, cover=True)
    return _rounded_square(image, px, ratio, radius)


def _rounded_square(image: QImage, px: int, ratio: float, radius: int) -> QImage:
    if image.isNull():
        return QImage()
    if min(image.width(), image.height()) < px:  # a small picture: blow it up to the square
        image = image.scaled(
            px, px, Qt.AspectRatioMode.KeepAspectRatioByExpanding, Qt.TransformationMode.SmoothTransformation
        )
    x, y = (image.width() - px) // 2, (image.height() - px) // 2
    square = image.copy(x, y, px, px)
    out = QImage(px, px, QImage.Format.Format_ARGB32_Premultiplied)
    out.fill(Qt.GlobalColor.transparent)
    painter = QPainter(out)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    clip = QPainterPath()
    clip.addRoundedRect(QRectF(0, 0, px, px), radius * ratio, radius * ratio)
    painter.setClipPath(clip)
    painter.drawImage(0, 0, square)
    painter.end()
    out.setDevicePixelRatio(ratio)
    return out


@dataclass(frozen=True)
class ImageCheck:
    """An attached image, checked: ``problem`` is the engine's reason it cannot be sent
    (None: it decodes), ``thumb`` its thumbnail (null when there is a problem)."""

    path: str
    problem: str | None
    thumb: QImage


def check_image(path: str | Path, size: int, ratio: float = 1.0, radius: int = 8) -> ImageCheck:
    """Decode the image in full (the engine's check), then make its thumbnail; the
    thumbnail is skipped for a damaged file, which Qt's decoders would only complain
    about. A format only Pillow reads (HEIC, AVIF) is thumbnailed from the checked
    bitmap instead of being decoded twice. Slow: run it as an ``app.ops.Op``."""
    from app.attachments import PILLOW_ONLY_EXT

    px = max(1, round(size * ratio))
    reuse = Path(path).suffix.lower() in PILLOW_ONLY_EXT
    try:
        problem, decoded = _decode(path, keep_fit=px if reuse else None)
    except Exception as exc:  # noqa: BLE001 - never leave an attachment "checking" for ever
        why = " ".join(str(exc).split()) or type(exc).__name__
        problem, decoded = f"{Path(path).name} could not be checked ({why}).", None
    if problem is not None:
        thumb = QImage()
    elif decoded is not None:
        thumb = _rounded_square(decoded, px, ratio, radius)
    else:
        thumb = thumbnail_image(path, size, ratio, radius)
    return ImageCheck(str(path), problem, thumb)
