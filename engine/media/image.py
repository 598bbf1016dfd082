"""Opening user images: any common format to an upright RGB PIL image.

PNG, JPEG, WebP, GIF, BMP and TIFF come with Pillow; HEIC/HEIF/AVIF from phones need
the pillow-heif plug-in, which is used when installed. EXIF orientation is applied
(phone photos are stored sideways with a rotate tag), and transparency is composited
onto white, the way transformers' image processors flatten RGBA.
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import MediaError
from engine.media.image_processors import (  # noqa: F401  (part of this module's API)
    Gemma3ImageProcessor,
    Qwen2VLImageProcessor,
    QwenVisionInput,
    smart_resize,
)

# ISO-BMFF brands that mean HEIF-family still images (HEIC, HEIF, AVIF).
_HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis"}
_heif_state: bool | None = None


def _heif_available() -> bool:
    """Register pillow-heif's opener once, if the package is installed."""
    global _heif_state
    if _heif_state is None:
        try:
            import pillow_heif  # type: ignore[import-not-found]

            pillow_heif.register_heif_opener()
            _heif_state = True
        except Exception:  # not installed, or built against another Pillow
            _heif_state = False
    return _heif_state


def _is_heif(head: bytes) -> bool:
    return head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS


def load_image(source: str | Path | bytes) -> Image.Image:
    """Decode a file path or encoded bytes to an RGB image, upright per its EXIF tag.

    Raises MediaError with the reason when the data is missing, not an image, corrupt
    or in a format this installation cannot decode.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, name = bytes(source), "the image"
    else:
        path = Path(source)
        name = path.name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MediaError(f"Image file not found: {path}") from None
        except OSError as e:
            raise MediaError(f"Cannot read image file {path}: {e.strerror or e}") from None
    if not data:
        raise MediaError(f"Image {name} is empty (0 bytes).")
    if _is_heif(data[:16]) and not _heif_available():
        raise MediaError(
            f"Image {name} is HEIC/HEIF, which needs the pillow-heif package "
            "(pip install pillow-heif); or export it as JPEG or PNG."
        )
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # decode now, inside the try, so truncation surfaces here
            return _to_rgb(ImageOps.exif_transpose(im))
    except UnidentifiedImageError:
        raise MediaError(f"{name} is not an image format that can be read (PNG, JPEG, WebP, GIF, ...).") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # warning if raised as error
        raise MediaError(f"Image {name} is too large to open safely: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"Image {name} is corrupt or truncated: {e}") from None


def _to_rgb(im: Image.Image) -> Image.Image:
    has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if im.mode == "RGB":
        return im.copy()
    return im.convert("RGB")
