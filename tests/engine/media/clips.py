"""A tiny lossless test clip made from the shared photos (used by the tests and by
tests/golden/make_qwen3_vl_goldens.py, so both decode the same pixels).

PNG frames in a QuickTime container: decoding gives back exactly the RGB written, on
any FFmpeg build, so no codec or colour conversion can differ between the referee and
the engine. 10 frames at 4 fps of 96 x 64 (multiples of Qwen3-VL's 32-pixel factor, so
the video processor keeps the size and no resize kernel is involved): the photos in
turn, each fading into the next.
"""

from __future__ import annotations

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


def make_clip(path: Path, images: Path) -> Path:
    import av

    out = av.open(str(path), "w", format="mov")
    stream = out.add_stream("png", rate=FPS)
    stream.width, stream.height, stream.pix_fmt = SIZE[0], SIZE[1], "rgb24"
    for frame in clip_frames(images):
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path
