"""The fast video path gives the numbers of the plain one.

Where each packet is plainly one frame (no B-frames), only the packets the sampled frames
need are decoded (from the keyframe before each); checked on an H.264 clip without
B-frames, against the same loader.

``VideoProcessor.from_clip`` decodes with FFmpeg's frame threads and turns each frame into
its patches on a pool of threads as it comes out of the decoder. Checked here on an H.264
clip with B-frames (decoded out of order, so frame threads have work to reorder) whose
size is not a multiple of the 32-pixel factor (so every frame is resized) and whose
sampled frame count is odd (so the last temporal patch is padded): the frames equal
transformers' PyAV loader run as it is (one decoder, default threading, every frame in
order), and the pixel values equal the whole-clip computation (Pillow's bicubic, then
(x - mean * 255) / (std * 255) in float32, then the patch layout) bit for bit.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import MediaError
from engine.media.qwen3_vl.processor import VideoProcessor
from engine.media.video import convert_frames, probe, read_frames
from tests.engine.media.clips import write_clip

av = pytest.importorskip("av")

SIZE, FPS, FRAMES = (200, 120), 10, 45  # 4.5 s: 9 frames at 2 a second


def h264_clip(path: Path, b_frames: int) -> Path:
    if "libx264" not in av.codecs_available:
        pytest.skip("this FFmpeg build has no libx264 encoder")
    options = {"preset": "ultrafast", "g": "12", "bf": str(b_frames), "x264-params": "scenecut=0"}
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)
    # Moving, and brightening.
    frames = (np.roll(base, 5 * i, axis=1) // 2 + np.uint8(3 * i) for i in range(FRAMES))
    return write_clip(path, "mp4", "libx264", "yuv420p", FPS, frames, **options)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return h264_clip(tmp_path_factory.mktemp("h264") / "clip.mp4", b_frames=2)


@pytest.fixture(scope="module")
def plain_clip(tmp_path_factory) -> Path:
    return h264_clip(tmp_path_factory.mktemp("h264") / "plain.mp4", b_frames=0)


def transformers_frames(path: Path, indices) -> np.ndarray:
    """transformers' read_video_pyav, as it decodes: one pass, PyAV's default threading."""
    container = av.open(str(path))
    frames = []
    for i, frame in enumerate(container.decode(video=0)):
        if i > indices[-1]:
            break
        if i in indices:
            frames.append(frame)
    video = np.stack([x.to_ndarray(format="rgb24") for x in frames])
    container.close()
    return video


def whole_clip_patches(processor: VideoProcessor, frames: np.ndarray) -> np.ndarray:
    """The processor's arithmetic on the whole clip at once (resize every frame, normalise
    the stack, pad, lay out the patches)."""
    n, height, width = frames.shape[:3]
    h, w = processor.frame_size(n, height, width)
    frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=processor.resample)) for f in frames])
    scale = np.float32(1.0 / processor.rescale_factor)
    mean = np.asarray(processor.image_mean, dtype=np.float32) * scale
    std = np.asarray(processor.image_std, dtype=np.float32) * scale
    x = ((frames.astype(np.float32) - mean) / std).transpose(0, 3, 1, 2)
    t, p, m = processor.temporal_patch_size, processor.patch_size, processor.merge_size
    if pad := -n % t:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    groups, c, gh, gw = x.shape[0] // t, x.shape[1], h // p, w // p
    x = x.reshape(groups, t, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(groups * gh * gw, c * t * p * p)


def test_threaded_decoding_gives_transformers_frames(clip):
    info = probe(clip)
    processor = VideoProcessor()
    indices = processor.sample(info.frames, info.fps)
    assert (info.frames, len(indices)) == (FRAMES, 9)
    want = transformers_frames(clip, indices.tolist())
    np.testing.assert_array_equal(read_frames(clip, indices), want)
    np.testing.assert_array_equal(read_frames(clip, indices, seek=True), want)


def test_frames_are_patched_as_they_decode_with_the_whole_clip_numbers(clip):
    info = probe(clip)
    processor = VideoProcessor()
    indices = processor.sample(info.frames, info.fps)
    frames = transformers_frames(clip, indices.tolist())
    want = whole_clip_patches(processor, frames)
    plain = processor(frames, indices, info.fps)
    fast = processor.from_clip(clip, indices, info.fps)
    assert fast.grid == plain.grid and fast.grid[0] == 5  # 9 frames: the last pair is padded
    assert fast.grid[1:] != (SIZE[1] // 16, SIZE[0] // 16)  # resized
    assert fast.timestamps == plain.timestamps and fast.indices == indices.tolist()
    assert fast.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(plain.pixel_values, want)
    np.testing.assert_array_equal(fast.pixel_values, want)


def test_a_clip_shorter_than_its_samples_gives_the_frames_it_has(clip):
    """Samples past the end (a header that overstates the length): the frames there are,
    sized for their own count, as the plain path gives them."""
    processor = VideoProcessor()
    indices = [0, 10, 20, 30, 40, 50, 60, 70]
    got = processor.from_clip(clip, indices, FPS)
    frames = read_frames(clip, indices)
    assert len(frames) == 5 and got.indices == indices[:5]
    want = processor(frames, indices[:5], FPS)
    assert got.grid == want.grid and got.timestamps == want.timestamps
    np.testing.assert_array_equal(got.pixel_values, want.pixel_values)


def test_each_frame_is_handed_over_once_and_errors_reach_the_caller(clip):
    seen: dict[int, tuple[int, ...]] = {}
    lock = threading.Lock()

    def work(k: int, rgb: np.ndarray) -> None:
        with lock:
            assert k not in seen
            seen[k] = rgb.shape

    assert convert_frames(clip, range(0, FRAMES, 2), work) == 23
    assert sorted(seen) == list(range(23)) and set(seen.values()) == {(SIZE[1], SIZE[0], 3)}

    def refuse(k: int, rgb: np.ndarray) -> None:
        if k == 3:
            raise MediaError("frame 3 refused")

    with pytest.raises(MediaError, match="frame 3 refused"):
        convert_frames(clip, range(FRAMES), refuse)


def test_without_b_frames_only_the_packets_the_samples_need_are_decoded(clip, plain_clip):
    from engine.media.video import _packet_plan

    processor = VideoProcessor()
    indices = processor.sample(FRAMES, FPS).tolist()
    assert indices == [0, 6, 11, 16, 22, 28, 33, 38, 44]
    assert _packet_plan(clip, indices) is None  # B-frames: every frame is decoded
    assert _packet_plan(clip, [0]) is None  # even when they come only after the wanted frame
    assert _packet_plan(plain_clip, [0])[0] == {0}  # a poster: one packet
    container = av.open(str(plain_clip))
    keyframes = [i for i, p in enumerate(p for p in container.demux(video=0) if p.size) if p.is_keyframe]
    container.close()
    assert keyframes == [0, 12, 24, 36]
    need, _ = _packet_plan(plain_clip, indices)
    # 23 follows frame 22 and 34, 35 frame 33 before the next keyframe: no sample needs them.
    assert need == set(range(FRAMES)) - {23, 34, 35}
    assert len(need) < FRAMES
    want = transformers_frames(plain_clip, indices)
    np.testing.assert_array_equal(read_frames(plain_clip, indices), want)
    fast = processor.from_clip(plain_clip, indices, FPS)
    np.testing.assert_array_equal(fast.pixel_values, whole_clip_patches(processor, want))
