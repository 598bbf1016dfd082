"""Pixtral's image preprocessing as Mistral 3 configures it (transformers' PIL backend):
the image shrinks, aspect kept, until its longest side fits ``longest_edge``, then each
side rounds up to whole merge blocks (patch * spatial_merge_size pixels); bicubic resize,
CLIP normalisation. One image is not padded. No MLX here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import MediaError
from engine.media.image_processors import (
    CLIP_MEAN,
    CLIP_STD,
    _check_rgb,
    _rescale_normalize,
)


@dataclass(frozen=True)
class PixtralImageProcessor:
    longest_edge: int = 1024
    block: int = 16  # patch_size * spatial_merge_size: both sides are multiples of it
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_config(cls, config: Mapping[str, Any], patch_size: int, merge: int) -> PixtralImageProcessor:
        size = config.get("size") or {}
        longest = size.get("longest_edge") or size.get("height") or cls.longest_edge
        return cls(
            longest_edge=int(longest),
            block=int(patch_size) * int(merge),
            resample=int(config.get("resample", cls.resample)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
        )

    def settings(self) -> dict[str, Any]:
        return {"processor": "pixtral", **asdict(self)}

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        if min(height, width) <= 0:
            raise MediaError(f"Image has no pixels ({width}x{height}).")
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        b = self.block
        return ((height - 1) // b + 1) * b, ((width - 1) // b + 1) * b

    def __call__(self, image: Image.Image) -> np.ndarray:
        """One image -> float32 (3, H, W), H and W multiples of ``block``."""
        rgb = _check_rgb(image)
        h, w = self.target_size(rgb.height, rgb.width)
        resized = rgb.resize((w, h), resample=self.resample)
        return _rescale_normalize(resized, self.rescale_factor, self.image_mean, self.image_std)
