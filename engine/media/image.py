"""Opening user images: any common format to an upright RGB PIL image.

PNG, JPEG, WebP, GIF, BMP, TIFF and AVIF come with Pillow; HEIC/HEIF (iPhone and macOS
Photos) come from pillow-heif, whose opener is registered with Pillow on first use.
Orientation: EXIF's tag is applied (cameras store JPEGs sideways with a rotate tag),
except for HEIF, where libheif has already applied the file's own rotation and mirror
boxes (which the format makes authoritative) and pillow-heif resets the EXIF tag, so
rotating again would turn the photo twice. Transparency is composited onto white, the
way transformers' image processors flatten RGBA.
"""

from __future__ import annotations

import io
import threading
import warnings
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError, features

from engine.errors import MediaError
from engine.files import IMAGE_FILE_LIMIT, read_bytes_bounded
from engine.media.image_limits import check_pixels, draft_reduced, reduced
from engine.media.image_processors import (  # noqa: F401  (part of this module's API)
    Gemma3ImageProcessor,
    Qwen2VLImageProcessor,
    QwenVisionInput,
    smart_resize,
)

# ISO-BMFF (ftyp) brands of HEIF-family stills: HEVC-coded HEIC/HEIF, and AVIF.
_HEIC_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}
_AVIF_BRANDS = {b"avif", b"avis"}
_heif_lock = threading.Lock()
_heif_state: list[str | None] = []  # empty until tried; then [None] or [why it failed]


def enable_heif() -> str | None:
    """Register pillow-heif's HEIC/HEIF opener with Pillow, once per process (the engine's
    thread and the app's thumbnails may both ask). None when Pillow reads HEIC now,
    otherwise why it cannot (a broken installation: pillow-heif is a dependency)."""
    with _heif_lock:
        if not _heif_state:
            try:
                import pillow_heif

                pillow_heif.register_heif_opener()
                _heif_state.append(None)
            except Exception as e:  # missing, or built against another Pillow
                _heif_state.append(" ".join(f"{type(e).__name__}: {e}".split()))
        return _heif_state[0]


def _container(data: bytes) -> str | None:
    """ "avif", "heif" or None, from the ftyp box's major and compatible brands."""
    if data[4:8] != b"ftyp":
        return None
    size = min(int.from_bytes(data[:4], "big"), len(data), 256)
    brands = {data[8:12]} | {data[i : i + 4] for i in range(16, size - 3, 4)}
    if brands & _AVIF_BRANDS and not brands & (_HEIC_BRANDS - {b"mif1", b"msf1"}):
        return "avif"
    return "heif" if brands & _HEIC_BRANDS else None


def upright(im: Image.Image) -> Image.Image:
    """``im`` turned the way it is meant to be seen (see the module docstring for HEIF)."""
    if im.format == "HEIF":
        return im
    return ImageOps.exif_transpose(im)


def _reason(e: BaseException) -> str:
    """An exception as one short line (libheif's messages span lines)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def load_image(source: str | Path | bytes) -> Image.Image:
    """Decode a file path or encoded bytes to an RGB image, upright per its orientation.

    Raises MediaError with the reason when the data is missing, not an image, corrupt
    or in a format this installation cannot decode.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, name = bytes(source), "data"
    else:
        path = Path(source)
        name = path.name
        try:
            data = read_bytes_bounded(path, IMAGE_FILE_LIMIT, "an image", MediaError)
        except FileNotFoundError:
            raise MediaError(f"Image file not found: {path}") from None
        except OSError as e:
            raise MediaError(f"Cannot read image file {path}: {e.strerror or e}") from None
    if not data:
        raise MediaError(f"Image {name} is empty (0 bytes).")
    container = _container(data[:256])
    if container == "heif" and (why := enable_heif()) is not None:
        raise MediaError(
            f"Image {name} is HEIC/HEIF, but this installation cannot decode it ({why}); "
            "reinstall MLX Desk, or export the photo as JPEG."
        )
    try:
        with warnings.catch_warnings():  # the size is checked here, with a readable line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im_file = Image.open(io.BytesIO(data))
        with im_file as im:
            check_pixels(im, name)  # from the header, before any pixel is decoded
            draft_reduced(im)  # a large JPEG decodes at a reduced scale
            im.load()  # decode now, inside the try, so truncation surfaces here
            return _to_rgb(reduced(upright(im)))
    except UnidentifiedImageError:
        if container == "heif" or (container == "avif" and features.check("avif")):
            # The header says HEIF/AVIF, but its boxes do not parse.
            raise MediaError(
                f"Image {name} is a corrupt or truncated {container.upper()} file; copy or export it again."
            ) from None
        if container == "avif":
            raise MediaError(
                f"Image {name} is AVIF, which this Pillow cannot decode (it needs "
                "Pillow 11.3 or later); update it, or export the image as JPEG."
            ) from None
        raise MediaError(f"{name} is not an image format that can be read (PNG, JPEG, WebP, HEIC, ...).") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # warning if raised as error
        raise MediaError(f"Image {name} is too large to open safely: {_reason(e)}") from None
    except (OSError, SyntaxError, ValueError, RuntimeError, EOFError) as e:
        raise MediaError(f"Image {name} is corrupt or truncated ({_reason(e)}); copy or export it again.") from None


def _to_rgb(im: Image.Image) -> Image.Image:
    has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if im.mode == "RGB":
        return im.copy()
    return im.convert("RGB")
