"""Qwen3-VL's video preprocessing, as transformers' Qwen3VLVideoProcessor does it.

Frames are sampled uniformly at ``fps`` per second of the clip (at least ``min_frames``,
at most ``max_frames`` and the clip's own count), sized so both sides are multiples of
patch * merge and the whole clip fits the pixel budget, padded to a whole number of
temporal patches with the last frame, rescaled and normalised (transformers' fused
form: (x - mean * 255) / (std * 255) in float32) and flattened into patches with each
merge block contiguous. Each temporal patch (two frames) becomes one run of tokens in
the prompt, after the timestamp of its frames' midpoint: ``<1.5 seconds>``.

Each frame is written into its place among the patches on its own (resized, normalised
and moved in one pass, in the same float32 operations as on the whole clip), so
``from_clip`` does it on the decoder's threads as frames come out of the decoder, and
no copy of the whole clip is made on the way.

Images go through the Qwen2-VL image processor (engine/media/image_processors.py) with
the model's settings. No MLX here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import MediaError

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


def video_size(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) every frame is resized to: transformers' video smart_resize
    (the pixel budget counts all frames, rounded to whole temporal patches)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"The video is {width}x{height}: an aspect ratio above 200:1 cannot be encoded.")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class VideoPatches:
    pixel_values: np.ndarray  # float32 (groups * h * w, C * T * p * p), groups in time order
    grid: tuple[int, int, int]  # (temporal groups, height, width) in patches
    timestamps: list[float]  # seconds, one per temporal group
    indices: list[int]  # the sampled frame numbers


@dataclass(frozen=True)
class VideoProcessor:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VideoProcessor:
        """From video_preprocessor_config.json's dict (unknown keys are ignored)."""
        size = config.get("size") or {}
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = config.get(key)
            return default if value is None else value

        return cls(
            fps=float(get("fps", d.fps)),
            min_frames=int(get("min_frames", d.min_frames)),
            max_frames=int(get("max_frames", d.max_frames)),
            min_pixels=int(size.get("shortest_edge") or get("min_pixels", d.min_pixels)),
            max_pixels=int(size.get("longest_edge") or get("max_pixels", d.max_pixels)),
            patch_size=int(get("patch_size", d.patch_size)),
            temporal_patch_size=int(get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(get("merge_size", d.merge_size)),
            resample=int(get("resample", d.resample)),
            rescale_factor=float(get("rescale_factor", d.rescale_factor)),
            image_mean=tuple(get("image_mean", d.image_mean)),
            image_std=tuple(get("image_std", d.image_std)),
            cap_pixels_per_frame=bool(get("cap_pixels_per_frame", False)),
            max_video_tokens=int(get("max_video_tokens", d.max_video_tokens)),
        )

    def settings(self) -> dict[str, Any]:
        return {"processor": "qwen3vl-video", **asdict(self)}

    def wanted(self, total: int, fps: float) -> int:
        """How many frames fps sampling asks for, before the frame limits."""
        return int(total / fps * self.fps)

    def sample(self, total: int, fps: float) -> np.ndarray:
        """The frame numbers to keep from a clip of ``total`` frames at ``fps``."""
        n = min(max(self.wanted(total, fps), self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int)

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(
                min(self.max_video_tokens * factor * factor, self.max_pixels // frames), int(self.min_pixels * 1.05)
            )
            max_pixels = per_frame * frames
        return video_size(frames, height, width, self.temporal_patch_size, factor, self.min_pixels, max_pixels)

    def timestamps(self, indices: Sequence[int], fps: float) -> list[float]:
        """Each temporal patch's time: the mean of its first and last frame's."""
        merge = self.temporal_patch_size
        indices = list(indices)
        if len(indices) % merge:
            indices += [indices[-1]] * (merge - len(indices) % merge)
        times = [i / fps for i in indices]
        return [(times[i] + times[i + merge - 1]) / 2 for i in range(0, len(times), merge)]

    def __call__(self, frames: np.ndarray, indices: Sequence[int], fps: float) -> VideoPatches:
        """Sampled frames (n, H, W, 3) uint8 -> patches, grid and timestamps."""
        n, height, width = frames.shape[:3]
        if n < 1:
            raise MediaError("The video has no frames to show the model.")
        patches = FramePatches(self, n, height, width, frames.shape[3])
        for k, frame in enumerate(frames):
            patches.put(k, frame)
        return patches.finish(n, indices, fps)

    def from_clip(
        self, source: str | Path | bytes, indices: Sequence[int], fps: float, *, seek: bool = False
    ) -> VideoPatches:
        """The frames numbered ``indices`` of a video file, decoded and turned into patches
        as they come (``self(read_frames(source, indices), indices, fps)``, the same numbers)."""
        from engine.media.video import convert_frames, read_frames

        made: list[FramePatches] = []
        lock = threading.Lock()

        def put(k: int, rgb: np.ndarray) -> None:
            with lock:  # the first frame says the clip's size
                if not made:
                    made.append(FramePatches(self, len(indices), *rgb.shape))
            made[0].put(k, rgb)

        n = convert_frames(source, indices, put, seek=seek)
        if not made or (n < len(indices) and self.frame_size(n, *made[0].source_size) != made[0].size):
            # A clip that broke off early: fewer frames may take a larger size.
            frames = read_frames(source, indices, seek=seek)
            return self(frames, list(indices)[: len(frames)], fps)
        return made[0].finish(n, list(indices)[:n], fps)

    def limited(self, total: int, fps: float) -> bool:
        """Whether a clip this long gets fewer frames than ``fps`` asks for (``max_frames``)."""
        return self.wanted(total, fps) > self.max_frames


class FramePatches:
    """The patches of a clip of ``n`` frames, filled a frame at a time, from any thread.

    Patches are laid out (groups, h/m, w/m, m, m, C, T, p, p): a frame is one temporal
    slot of its group, so each frame is resized, normalised and written there alone.
    The normalisation is transformers' fused form in float32, (x - mean * 255) / (std * 255),
    the same operations, value for value, as on the whole clip at once.
    """

    def __init__(self, processor: VideoProcessor, n: int, height: int, width: int, channels: int):
        self.processor = processor
        self.source_size = (height, width)
        self.size = processor.frame_size(n, height, width)
        t, p, m = processor.temporal_patch_size, processor.patch_size, processor.merge_size
        h, w = self.size
        groups = -(-n // t)
        self.out = np.empty((groups, h // p // m, w // p // m, m, m, channels, t, p, p), dtype=np.float32)
        scale = np.float32(1.0 / processor.rescale_factor)
        self.mean = (np.asarray(processor.image_mean, dtype=np.float32) * scale)[:, None, None]
        self.std = (np.asarray(processor.image_std, dtype=np.float32) * scale)[:, None, None]

    def slot(self, k: int) -> np.ndarray:
        """Where frame ``k`` goes: (h/m, w/m, m, m, C, p, p)."""
        t = self.processor.temporal_patch_size
        return self.out[k // t, :, :, :, :, :, k % t]

    def put(self, k: int, frame: np.ndarray) -> None:
        """Frame ``k`` of the clip, uint8 (H, W, C)."""
        self.write(k, self.resize(frame))

    def resize(self, frame: np.ndarray) -> np.ndarray:
        """A frame of the clip at the size the model sees."""
        if frame.shape[:2] != self.source_size:
            raise MediaError(
                f"The video changes its frame size mid-clip ({self.source_size[1]}x{self.source_size[0]} to "
                f"{frame.shape[1]}x{frame.shape[0]}); re-encode it at one size."
            )
        h, w = self.size
        if (h, w) == self.source_size:
            return frame
        # transformers resizes video with torchvision's kernels; Pillow's bicubic is close
        # to them but not bit-equal.
        return np.asarray(Image.fromarray(frame).resize((w, h), resample=self.processor.resample))

    def write(self, k: int, frame: np.ndarray) -> None:
        """Frame ``k``, already resized: normalised into its patches."""
        h, w = self.size
        p, m = self.processor.patch_size, self.processor.merge_size
        blocks = frame.reshape(h // p // m, m, p, w // p // m, m, p, frame.shape[2]).transpose(0, 3, 1, 4, 6, 2, 5)
        slot = self.slot(k)
        np.subtract(blocks, self.mean, out=slot, dtype=np.float32)
        np.divide(slot, self.std, out=slot)

    def finish(self, n: int, indices: Sequence[int], fps: float) -> VideoPatches:
        """The patches of the first ``n`` frames (all put), the last one repeated to fill its
        temporal patch."""
        t = self.processor.temporal_patch_size
        groups = -(-n // t)
        for k in range(n, groups * t):
            self.slot(k)[...] = self.slot(n - 1)
        out = self.out[:groups]
        gh, gw = (side // self.processor.patch_size for side in self.size)
        pixels = out.reshape(groups * gh * gw, -1)
        return VideoPatches(
            pixels, (groups, gh, gw), self.processor.timestamps(indices, fps), [int(i) for i in indices]
        )
