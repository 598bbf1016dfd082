"""Big images: refused above a stated pixel limit from the header alone, decoded reduced
below it; the window refuses a 144-megapixel image in one line without a stall."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import MediaError
from engine.media.image import load_image
from engine.media.image_limits import MAX_DECODED_PIXELS, MAX_PIXELS

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(path: Path, width: int = 12_000, height: int = 12_000) -> Path:
    """A PNG whose header is 144 megapixels, with the first rows of real (white) pixels:
    the size a 12,000 × 12,000 scan would claim, in a few KB."""
    rows = b"".join(b"\0" + b"\xff" * (3 * width) for _ in range(4))
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )
    return path


def test_a_144_megapixel_image_is_refused_from_its_header(tmp_path):
    path = huge_png(tmp_path / "scan.png")
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(MediaError) as err:
        load_image(path)
    took = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    line = str(err.value)
    assert "scan.png is 12,000×12,000 (144 megapixels)" in line and "\n" not in line
    assert f"up to {MAX_PIXELS // 1_000_000} megapixels" in line
    assert took < 0.5 and peak < 50 << 20  # nothing the size of the pixels was allocated


def test_a_large_jpeg_is_decoded_reduced(tmp_path):
    path = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (75, 100, 3), dtype=np.uint8)
    Image.fromarray(small).resize((6000, 4500), Image.Resampling.BILINEAR).save(path, quality=85)  # 27 MP
    image = load_image(path)
    assert image.width * image.height <= MAX_DECODED_PIXELS
    assert image.width * image.height >= MAX_DECODED_PIXELS / 4  # reduced by the decoder's 1/2, not more
    assert abs(image.width / image.height - 6000 / 4500) < 0.01


def test_a_large_png_is_reduced_after_decoding(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (8000, 2500), (10, 200, 30)).save(path)  # 20 MP
    image = load_image(path)
    assert image.size == (4000, 1250)
    assert image.getpixel((100, 100)) == (10, 200, 30)


def test_images_below_the_decode_size_are_untouched(tmp_path):
    path = tmp_path / "normal.png"
    Image.new("RGB", (1024, 768), (1, 2, 3)).save(path)
    assert load_image(path).size == (1024, 768)


def test_the_window_refuses_a_144_megapixel_image_without_a_stall(qtbot, make_window, tmp_path):
    from app.qt import QTimer
    from tests.app.test_app_images import drop, url_mime

    window = make_window()
    window.composer.set_capabilities(image=True, audio=False)
    path = huge_png(tmp_path / "scan.png")
    gaps, last = [0.0], [time.perf_counter()]

    def tick():
        now = time.perf_counter()
        gaps[0] = max(gaps[0], now - last[0])
        last[0] = now

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(5)
    with qtbot.wait_signal(window.composer.refused, timeout=30_000) as blocker:
        drop(window.composer, url_mime(path))
    timer.stop()
    reason = blocker.args[0]
    assert "144 megapixels" in reason and "\n" not in reason
    assert window.composer.attachments == []
    assert gaps[0] < 0.25, f"the window stalled {gaps[0] * 1000:.0f} ms"


GOLDEN_VIDEO_MODEL = Path(__file__).resolve().parents[1] / "golden" / "qwen3_vl" / "qwen3_vl"


@pytest.mark.parametrize("case", ["three hours", "corrupt", "no video stream"])
def test_bad_videos_through_the_cli(tmp_path, capsys, shared_data, case):
    """A 3-hour video is sampled (one note line, quickly); a corrupt file or one with no
    video stream gets one error line."""
    pytest.importorskip("av")
    from engine.cli.main import main
    from tests.engine.media.clips import make_clip, make_three_hour_clip

    if case == "three hours":
        path = make_three_hour_clip(tmp_path / "lecture.mov")
    elif case == "corrupt":
        path = tmp_path / "cut.mov"
        path.write_bytes(make_clip(tmp_path / "whole.mov", shared_data / "images").read_bytes()[:300])
    else:
        path = shared_data / "audio" / "jfk.wav"
    args = ["generate", "--model", str(GOLDEN_VIDEO_MODEL), "--chat", "--prompt", "what happens?"]
    started = time.perf_counter()
    code = main([*args, "--video", str(path), "--max-tokens", "2", "--json"])
    took = time.perf_counter() - started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    if case == "three hours":
        assert code == 0
        assert err.startswith("note: A video of 3 h 00 min is longer") and "sampled to 3 frames" in err
        assert took < 20
    else:
        assert code != 0 and err.startswith("error: ")
        assert ("no video stream" if case == "no video stream" else "not a video") in err or "corrupt" in err
