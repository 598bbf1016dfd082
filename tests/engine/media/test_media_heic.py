"""HEIC/HEIF (iPhone and macOS Photos) and AVIF pictures through the engine's opener.

The HEIC files are made here with pillow-heif: from the JPEG in ../shared/data/images and
from synthetic pictures with an EXIF orientation tag, an alpha channel, or 10-bit depth.
The referee for "the model sees what it would see from a JPEG/PNG of the same photo" is
pillow-heif's own decoder: its output saved losslessly as PNG and run through the PNG path
must give the very same pixels, and the same preprocessed model input, as the HEIC.
"""

from __future__ import annotations

import io

import numpy as np
import pillow_heif
import pytest
from PIL import Image, features

import engine.media.image as image_module
from engine.errors import MediaError
from engine.media.image import Gemma3ImageProcessor, Qwen2VLImageProcessor, enable_heif, load_image

ORIENTATION = 0x0112
# Lossless HEIC: full chroma and the identity matrix, so RGB survives bit for bit.
LOSSLESS = {"quality": -1, "chroma": 444, "matrix_coefficients": 0}


def _heic(im: Image.Image, orientation: int | None = None, **options) -> bytes:
    assert enable_heif() is None  # pillow-heif is a dependency: registration must work
    if orientation is not None:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        options["exif"] = exif.tobytes()
    buf = io.BytesIO()
    im.save(buf, format="HEIF", **options)
    return buf.getvalue()


def _png(im: Image.Image, orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    if orientation is None:
        im.save(buf, format="PNG")
    else:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        im.save(buf, format="PNG", exif=exif)
    return buf.getvalue()


def _reference_png(heic: bytes) -> bytes:
    """The HEIC decoded by pillow-heif itself (no Pillow plug-in, no engine code), as PNG."""
    decoded = pillow_heif.open_heif(io.BytesIO(heic), convert_hdr_to_8bit=True).to_pillow()
    return _png(decoded)


def _quadrants(width: int = 40, height: int = 30) -> np.ndarray:
    """Red, green / blue, white quarters with a little texture: any turn or mirror shows."""
    rng = np.random.default_rng(7)
    px = np.zeros((height, width, 3), dtype=np.uint8)
    h, w = height // 2, width // 2
    px[:h, :w], px[:h, w:], px[h:, :w], px[h:, w:] = (220, 30, 30), (30, 200, 40), (40, 50, 210), (240, 240, 240)
    return (px.astype(int) + rng.integers(-20, 20, size=px.shape)).clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def rocket_heic(shared_data) -> bytes:
    """The JPEG photo re-encoded as an ordinary (lossy) HEIC, as a phone would store it."""
    with Image.open(shared_data / "images" / "rocket.jpg") as jpeg:
        return _heic(jpeg.convert("RGB"), quality=90)


def test_heic_photo_gives_the_model_what_its_png_gives(rocket_heic, shared_data, tmp_path):
    path = tmp_path / "IMG_0001.HEIC"
    path.write_bytes(rocket_heic)
    im = load_image(path)
    assert im.mode == "RGB" and im.size == (640, 427)
    reference = load_image(_reference_png(rocket_heic))
    np.testing.assert_array_equal(np.asarray(im), np.asarray(reference))
    # It is the same photo as the JPEG (not turned, not another picture): close, lossy.
    jpeg = np.asarray(load_image(shared_data / "images" / "rocket.jpg")).astype(float)
    mse = ((np.asarray(im).astype(float) - jpeg) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 30

    gemma = Gemma3ImageProcessor()
    np.testing.assert_array_equal(gemma([im]), gemma([reference]))
    qwen = Qwen2VLImageProcessor()
    got, want = qwen([im]), qwen([reference])
    np.testing.assert_array_equal(got.image_grid_thw, want.image_grid_thw)
    np.testing.assert_array_equal(got.pixel_values, want.pixel_values)


@pytest.mark.parametrize("orientation", [2, 3, 6, 8])
def test_heic_orientation_matches_a_png_with_the_same_tag(orientation):
    """libheif applies the rotation the file stores; the engine must not apply EXIF again."""
    px = _quadrants()
    heic = _heic(Image.fromarray(px), orientation, **LOSSLESS)
    got = np.asarray(load_image(heic))
    same_photo_as_png = np.asarray(load_image(_png(Image.fromarray(px), orientation)))
    np.testing.assert_array_equal(got, same_photo_as_png)
    expected = {2: px[:, ::-1], 3: np.rot90(px, 2), 6: np.rot90(px, -1), 8: np.rot90(px, 1)}[orientation]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, np.asarray(load_image(_reference_png(heic))))


def test_heic_with_alpha_is_flattened_on_white_like_a_png():
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, size=(12, 20, 4), dtype=np.uint8)
    rgba[:, :5, 3] = 0  # a fully transparent band must come out white
    heic = _heic(Image.fromarray(rgba, "RGBA"), **LOSSLESS)
    with Image.open(io.BytesIO(heic)) as opened:
        assert opened.mode == "RGBA"
    got = np.asarray(load_image(heic))
    np.testing.assert_array_equal(got, np.asarray(load_image(_png(Image.fromarray(rgba, "RGBA")))))
    assert (got[:, :5] == 255).all()
    decoded = pillow_heif.open_heif(io.BytesIO(heic)).to_pillow()
    assert decoded.mode == "RGBA"
    np.testing.assert_array_equal(got, np.asarray(load_image(_png(decoded))))


def test_ten_bit_heic_comes_out_as_8_bit_rgb():
    rng = np.random.default_rng(5)
    ten_bit = rng.integers(0, 1024, size=(16, 24, 3)).astype(np.uint16)
    # pillow-heif takes 16-bit samples; it stores the top 10 bits.
    heif = pillow_heif.from_bytes(mode="RGB;16", size=(24, 16), data=(ten_bit << 6).astype("<u2").tobytes())
    buf = io.BytesIO()
    heif.save(buf, **LOSSLESS)
    heic = buf.getvalue()
    assert pillow_heif.open_heif(io.BytesIO(heic), convert_hdr_to_8bit=False).info["bit_depth"] == 10
    im = load_image(heic)
    assert im.mode == "RGB" and im.size == (24, 16)
    got = np.asarray(im)
    np.testing.assert_array_equal(got, np.asarray(load_image(_reference_png(heic))))
    assert np.abs(got - ten_bit.astype(float) * 255 / 1023).max() <= 1.0


def test_damaged_heic_is_one_actionable_line(rocket_heic, tmp_path):
    for keep in (len(rocket_heic) // 2, 48):  # the picture cut short; the header cut short
        path = tmp_path / "IMG_0002.heic"
        path.write_bytes(rocket_heic[:keep])
        with pytest.raises(MediaError, match="IMG_0002.heic is (a )?corrupt or truncated") as info:
            load_image(path)
        message = str(info.value)
        assert "\n" not in message and message.endswith("copy or export it again.")


def test_a_broken_heif_install_says_so(monkeypatch, rocket_heic):
    monkeypatch.setattr(image_module, "_heif_state", ["ImportError: No module named 'pillow_heif'"])
    with pytest.raises(MediaError, match="HEIC/HEIF, but this installation cannot decode it.*reinstall"):
        load_image(rocket_heic)


@pytest.mark.skipif(not features.check("avif"), reason="this Pillow has no AVIF codec")
def test_avif_is_upright_per_its_orientation():
    px = _quadrants(64, 48)
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="AVIF", exif=exif.tobytes(), quality=95)
    got = np.asarray(load_image(buf.getvalue())).astype(int)
    want = np.rot90(px, -1).astype(int)
    assert got.shape == want.shape
    assert np.abs(got - want).mean() < 12  # lossy, but the quarters are where they belong
    with pytest.raises(MediaError, match="corrupt or truncated AVIF"):
        load_image(buf.getvalue()[:60])
