"""Image loading and the Gemma 3 / Qwen2-VL pixel preprocessing.

The processors are compared with transformers' own image processors (PIL backend) run
on the photos in ../shared/data/images: tests/golden/media/{gemma3,qwen2vl}_images.npz,
made by tests/golden/make_media_goldens.py, hold per-image totals, per-row and
per-column means and a strided sample of every output.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features

from engine.errors import MediaError
from engine.media.image import Gemma3ImageProcessor, Qwen2VLImageProcessor, load_image, smart_resize

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"
META = json.loads((GOLDEN / "versions.json").read_text())
PHOTOS = {"astronaut.png": (512, 512), "chelsea.png": (451, 300), "coffee.png": (600, 400), "rocket.jpg": (640, 427)}
ATOL = 1e-5


def _gold(name: str) -> dict:
    with np.load(GOLDEN / name) as z:
        return {k: z[k] for k in z.files}


def _check_summary(gold: dict, prefix: str, x: np.ndarray) -> None:
    assert tuple(gold[f"{prefix}/shape"]) == x.shape, prefix
    np.testing.assert_allclose(x.reshape(-1)[:: META["image_stride"]], gold[f"{prefix}/strided"], atol=ATOL, rtol=0)
    x64 = x.astype(np.float64)
    total, abs_total, energy, lo, hi = gold[f"{prefix}/stats"]
    np.testing.assert_allclose([abs_total, energy], [np.abs(x64).sum(), (x64**2).sum()], rtol=1e-6)
    np.testing.assert_allclose(x64.sum(), total, atol=ATOL * x.size**0.5)
    np.testing.assert_allclose([x64.min(), x64.max()], [lo, hi], atol=ATOL)


# ---- loading ---------------------------------------------------------------------


def test_photos_load_as_rgb(shared_data):
    for name, size in PHOTOS.items():
        im = load_image(shared_data / "images" / name)
        assert im.mode == "RGB" and im.size == size, name


def test_bytes_and_path_give_the_same_pixels(shared_data):
    path = shared_data / "images" / "rocket.jpg"
    np.testing.assert_array_equal(np.asarray(load_image(path)), np.asarray(load_image(path.read_bytes())))


def _png(array: np.ndarray, mode: str | None = None, exif: Image.Exif | None = None) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    im.save(buf, format="PNG", exif=exif) if exif is not None else im.save(buf, format="PNG")
    return buf.getvalue()


def test_exif_orientation_is_applied():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(3, 5, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    im = load_image(_png(pixels, exif=exif))
    assert im.size == (3, 5)  # width, height swapped
    np.testing.assert_array_equal(np.asarray(im), np.rot90(pixels, k=-1))


def test_transparency_is_composited_on_white_and_grey_is_expanded():
    rgba = np.array([[[200, 100, 0, 255], [200, 100, 0, 0], [0, 0, 0, 128]]], dtype=np.uint8)
    got = np.asarray(load_image(_png(rgba))).astype(int)
    alpha = rgba[..., 3:4] / 255.0
    expected = rgba[..., :3] * alpha + 255 * (1 - alpha)
    np.testing.assert_allclose(got, expected, atol=1)
    grey = np.array([[0, 77, 255]], dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(load_image(_png(grey))), np.repeat(grey[..., None], 3, axis=-1))


@pytest.mark.skipif(not features.check("webp"), reason="this Pillow has no WebP codec")
def test_webp_loads():
    pixels = np.random.default_rng(1).integers(0, 256, size=(8, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="WEBP", lossless=True)
    np.testing.assert_array_equal(np.asarray(load_image(buf.getvalue())), pixels)


def test_unreadable_images_raise_media_error(tmp_path, shared_data):
    with pytest.raises(MediaError, match="not found"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(MediaError, match="empty"):
        load_image(b"")
    with pytest.raises(MediaError, match="not an image"):
        load_image(b"hello, this is text and not a picture")
    jpeg = (shared_data / "images" / "rocket.jpg").read_bytes()
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load_image(jpeg[: len(jpeg) // 2])
    png = (shared_data / "images" / "chelsea.png").read_bytes()
    with pytest.raises(MediaError, match="corrupt or truncated") as info:
        load_image(png[: len(png) // 3])
    assert "\n" not in str(info.value)


# ---- Gemma 3 ---------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(META["gemma3_cases"]))
def test_gemma3_processor_matches_transformers(shared_data, case):
    gold = _gold("gemma3_images.npz")
    proc = Gemma3ImageProcessor.from_config(META["gemma3_cases"][case])
    for name in META["images"]:
        pv = proc([load_image(shared_data / "images" / name)])
        assert pv.dtype == np.float32 and pv.shape == (1, 3, 896, 896)
        prefix = f"{case}/{name}"
        _check_summary(gold, prefix, pv[0])
        np.testing.assert_allclose(pv[0].astype(np.float64).mean(axis=-1), gold[f"{prefix}/row_means"], atol=1e-6)
        np.testing.assert_allclose(pv[0].astype(np.float64).mean(axis=-2), gold[f"{prefix}/col_means"], atol=1e-6)


def test_gemma3_batch_and_config():
    proc = Gemma3ImageProcessor(size=32)
    ims = [Image.new("RGB", (40, 20), (255, 0, 128)), Image.new("L", (10, 50), 0)]
    pv = proc(ims)
    assert pv.shape == (2, 3, 32, 32)
    np.testing.assert_allclose(pv[0, :, 5, 5], [1.0, -1.0, 128 / 255 * 2 - 1], atol=1e-6)
    np.testing.assert_allclose(pv[1], -1.0)
    assert proc.settings()["size"] == 32
    # Published configs write null for "the processor's default".
    pas = Gemma3ImageProcessor.from_config({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": None})
    assert pas.pan_and_scan and pas.pan_and_scan_min_crop_size == 256
    with pytest.raises(MediaError, match="pan-and-scan"):
        Gemma3ImageProcessor.from_config({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 1})


# ---- Qwen2-VL --------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(META["qwen2vl_cases"]))
def test_qwen2vl_processor_matches_transformers(shared_data, case):
    gold = _gold("qwen2vl_images.npz")
    proc = Qwen2VLImageProcessor.from_config(META["qwen2vl_cases"][case])
    for name in META["images"]:
        out = proc([load_image(shared_data / "images" / name)])
        prefix = f"{case}/{name}"
        np.testing.assert_array_equal(out.image_grid_thw, gold[f"{prefix}/grid_thw"])
        assert out.pixel_values.dtype == np.float32
        _check_summary(gold, prefix, out.pixel_values)
        pv64 = out.pixel_values.astype(np.float64)
        np.testing.assert_allclose(pv64.mean(axis=1), gold[f"{prefix}/patch_means"], atol=1e-6)
        np.testing.assert_allclose(pv64.mean(axis=0), gold[f"{prefix}/feature_means"], atol=1e-6)


def test_qwen2vl_several_images_concatenate_in_order(shared_data):
    gold = _gold("qwen2vl_images.npz")
    out = Qwen2VLImageProcessor()([load_image(shared_data / "images" / n) for n in META["images"]])
    np.testing.assert_array_equal(out.image_grid_thw, gold["batch/grid_thw"])
    _check_summary(gold, "batch", out.pixel_values)
    assert out.pixel_values.shape[0] == int(np.prod(out.image_grid_thw, axis=1).sum())


def test_qwen2vl_patch_layout():
    """Each row is one 14x14 patch, channel-major, the still frame repeated twice in time;
    rows walk 2x2 merge blocks in raster order."""
    proc = Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=56 * 56, image_mean=(0, 0, 0), image_std=(1, 1, 1), rescale_factor=1.0
    )
    chw = np.arange(3 * 56 * 56, dtype=np.float32).reshape(3, 56, 56)
    patches = proc.patchify(chw)
    assert patches.shape == (16, 3 * 2 * 14 * 14)
    for row, (by, bx, my, mx) in enumerate(
        (by, bx, my, mx) for by in range(2) for bx in range(2) for my in range(2) for mx in range(2)
    ):
        y, x = (by * 2 + my) * 14, (bx * 2 + mx) * 14
        expected = np.stack([chw[:, y : y + 14, x : x + 14]] * 2, axis=1).reshape(-1)
        np.testing.assert_array_equal(patches[row], expected)


def test_smart_resize_bounds():
    for h, w in [(300, 451), (427, 640), (10, 10), (4000, 3000), (28, 5000)]:
        rh, rw = smart_resize(h, w)
        assert rh % 28 == 0 and rw % 28 == 0
        assert 56 * 56 <= rh * rw <= 28 * 28 * 1280
    assert smart_resize(300, 451) == (308, 448)
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(10, 2100)


def test_qwen2vl_config_keys():
    proc = Qwen2VLImageProcessor.from_config(
        {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "resample": 3,
            "image_processor_type": "Qwen2VLImageProcessor",
        }
    )
    assert (proc.min_pixels, proc.max_pixels) == (3136, 12845056)
    sized = Qwen2VLImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 200000}})
    assert (sized.min_pixels, sized.max_pixels) == (100, 200000)


def test_oversized_images_are_refused(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 3x5=15 fine, 30x40=1200 > 2x limit
    assert load_image(_png(np.zeros((3, 5, 3), dtype=np.uint8))).size == (5, 3)
    with pytest.raises(MediaError, match="too large"):
        load_image(_png(np.zeros((30, 40, 3), dtype=np.uint8)))
