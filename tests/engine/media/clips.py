"""A tiny lossless test clip made from the shared photos (used by the tests and by
tests/golden/make_qwen3_vl_goldens.py, so both decode the same pixels).

PNG frames in a QuickTime container: decoding gives back exactly the RGB written, on
any FFmpeg build, so no codec or colour conversion can differ between the referee and
the engine. 10 frames at 4 fps of 96 x 64 (multiples of Qwen3-VL's 32-pixel factor, so
the video processor keeps the size and no resize kernel is involved): the photos in
turn, each fading into the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = ("chelsea.png", "astronaut.png", "coffee.png", "rocket.jpg")
SIZE = (96, 64)  # width, height
FRAMES, FPS = 10, 4


def clip_frames(images: Path) -> list[np.ndarray]:
    stills = [
        np.asarray(Image.open(images / name).convert("RGB").resize(SIZE, Image.Resampling.BICUBIC), dtype=np.uint16)
        for name in PHOTOS
    ]
    frames = []
    for i in range(FRAMES):
        a, b = stills[i * len(stills) // FRAMES], stills[(i * len(stills) // FRAMES + 1) % len(stills)]
        mix = (i * len(stills)) % FRAMES  # 0 .. FRAMES-1: how far into the fade
        frames.append(((a * (FRAMES - mix) + b * mix) // FRAMES).astype(np.uint8))
    return frames


def make_clip(path: Path, images: Path, *, reverse: bool = False) -> Path:
    """The clip; with ``reverse`` its frames run backwards (other bytes, the same size)."""
    frames = clip_frames(images)
    return write_clip(path, "mov", "png", "rgb24", FPS, frames[::-1] if reverse else frames)


def write_clip(
    path: Path, container: str, codec: str, pix_fmt: str, fps: int, frames: Iterable[np.ndarray], **options: str
) -> Path:
    """Encode RGB ``frames`` [H, W, 3] (uint8) into ``path``; ``options`` go to the encoder."""
    import av

    frames = iter(frames)
    first = next(frames)
    out = av.open(str(path), "w", format=container)
    stream = out.add_stream(codec, rate=fps, options=options or None)
    stream.height, stream.width = first.shape[:2]
    stream.pix_fmt = pix_fmt
    for frame in itertools.chain([first], frames):
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path


def make_long_clip(path: Path, seconds: int = 25 * 60, fps: int = 2, gop: int = 30) -> Path:
    """A long clip that is cheap to make: ``seconds`` at ``fps`` frames a second, 64 x 64,
    H.264 with a keyframe every ``gop`` frames (so reading a frame by seeking decodes from
    the keyframe before it). Each frame differs: a level that moves with its number."""
    import av

    out = av.open(str(path), "w", format="mp4")
    stream = out.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "g": str(gop), "bf": "0"})
    stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
    ramp = np.linspace(0, 63, 64, dtype=np.uint16)[None, :, None]
    for i in range(seconds * fps):
        level = (i * 37) % 192
        frame = np.broadcast_to((ramp + level).astype(np.uint8), (64, 64, 3))
        for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path


def make_three_hour_clip(path: Path) -> Path:
    """Three frames, one an hour: a three-hour video in a few hundred bytes."""
    from fractions import Fraction

    import av

    out = av.open(str(path), "w", format="mov")
    stream = out.add_stream("png", rate=Fraction(1, 3600))
    stream.width, stream.height, stream.pix_fmt = 32, 32, "rgb24"
    for i in range(3):
        frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 60 * i, dtype=np.uint8), format="rgb24")
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path
