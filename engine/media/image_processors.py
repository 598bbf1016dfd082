"""Pixel preprocessing for the vision towers, identical to transformers' PIL backend.

Every step mirrors what transformers does on its PIL path so the towers see the same
numbers: Pillow resizes the uint8 image, rescaling is done in float64 then cast to
float32, normalisation in float32. (transformers' torchvision backend, used there when
torchvision is installed, resizes with its own kernels and differs in the last bits.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import MediaError

SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _rescale_normalize(
    rgb: Image.Image, factor: float, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:
    """uint8 HWC image -> float32 CHW, (x * factor - mean) / std, in transformers' dtypes."""
    x = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    x = (x.astype(np.float64) * factor).astype(np.float32)
    m = np.asarray(mean, dtype=np.float32)[:, None, None]
    s = np.asarray(std, dtype=np.float32)[:, None, None]
    return (x - m) / s


def _check_rgb(image: Image.Image) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise MediaError(f"Expected a decoded image (use load_image first), got {type(image).__name__}.")
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """SigLIP preprocessing as Gemma 3 configures it: a square resize, then (x/255 - 0.5) / 0.5.

    Published Gemma 3 checkpoints ask for bilinear resampling (``resample: 2``) at 896 px.
    """

    size: int = 896
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Gemma3ImageProcessor:
        """From a preprocessor_config.json dict (unknown keys are ignored)."""
        if config.get("do_pan_and_scan"):
            raise MediaError("Gemma 3 pan-and-scan cropping is not supported; turn do_pan_and_scan off.")
        size = config.get("size") or {}
        return cls(
            size=int(size.get("height", cls.size)) if isinstance(size, Mapping) else int(size),
            resample=int(config.get("resample", cls.resample)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
        )

    def settings(self) -> dict[str, Any]:
        return {"processor": "gemma3", **asdict(self)}

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Images -> pixel_values, float32 (N, 3, size, size)."""
        if not images:
            raise ValueError("Gemma3ImageProcessor needs at least one image")
        out = []
        for image in images:
            resized = _check_rgb(image).resize((self.size, self.size), resample=self.resample)
            out.append(_rescale_normalize(resized, self.rescale_factor, self.image_mean, self.image_std))
        return np.stack(out)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of ``factor``, area within the bounds,
    aspect ratio kept as closely as that allows. Rounds half to even, like Python's round()."""
    if min(height, width) <= 0:
        raise MediaError(f"Image has no pixels ({width}x{height}).")
    if max(height, width) / min(height, width) > 200:
        raise MediaError(
            f"Image is {width}x{height}: an aspect ratio above 200:1 cannot be encoded; crop it first."
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@dataclass
class QwenVisionInput:
    pixel_values: np.ndarray  # float32 (total patches, C * temporal_patch_size * patch_size**2)
    image_grid_thw: np.ndarray  # int64 (images, 3): temporal, height, width in patches
    sizes: list[tuple[int, int]] = field(default_factory=list)  # resized (height, width) per image


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL preprocessing: dynamic resolution, CLIP normalisation, and
    flattening into patches ordered so that each merge_size x merge_size block is contiguous."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Qwen2VLImageProcessor:
        """From a preprocessor_config.json dict; ``min_pixels``/``max_pixels`` win over ``size``."""
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        max_pixels = config.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        return cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(config.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(config.get("merge_size", cls.merge_size)),
            resample=int(config.get("resample", cls.resample)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
        )

    def settings(self) -> dict[str, Any]:
        return {"processor": "qwen2vl", **asdict(self)}

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def patchify(self, chw: np.ndarray) -> np.ndarray:
        """(C, H, W) -> (grid_h * grid_w, C * T * p * p); a still image fills all T frames."""
        c, h, w = chw.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = chw.reshape(c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p)

    def __call__(self, images: Sequence[Image.Image]) -> QwenVisionInput:
        if not images:
            raise ValueError("Qwen2VLImageProcessor needs at least one image")
        patches, grids, sizes = [], [], []
        for image in images:
            rgb = _check_rgb(image)
            h, w = self.target_size(rgb.height, rgb.width)
            resized = rgb.resize((w, h), resample=self.resample)
            chw = _rescale_normalize(resized, self.rescale_factor, self.image_mean, self.image_std)
            patches.append(self.patchify(chw))
            grids.append((1, h // self.patch_size, w // self.patch_size))
            sizes.append((h, w))
        return QwenVisionInput(
            pixel_values=np.concatenate(patches, axis=0),
            image_grid_thw=np.asarray(grids, dtype=np.int64),
            sizes=sizes,
        )
