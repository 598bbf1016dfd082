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


def _rescale_normalize(rgb: Image.Image, factor: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
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


def pan_and_scan_boxes(
    width: int, height: int, min_crop_size: int = 256, max_num_crops: int = 4, min_ratio: float = 1.2
) -> list[tuple[int, int, int, int]]:
    """Gemma 3's pan-and-scan crops of a ``width`` x ``height`` image, as Pillow boxes
    (left, top, right, bottom), row by row; empty when the image is not elongated enough
    or the crops would come out smaller than ``min_crop_size`` on a side.

    The rule is transformers': the long side is cut into about as many equal squares as
    the aspect ratio says (half rounds up), never fewer than 2 nor more than
    ``max_num_crops``, and not so many that a crop's long side drops below the minimum.
    The last crop keeps only what lies inside the image (it is not padded).
    """
    if width >= height:
        if width / height < min_ratio:
            return []
        across = min(int(math.floor(width / height + 0.5)), int(math.floor(width / min_crop_size)))
        across, down = min(max_num_crops, max(2, across)), 1
    else:
        if height / width < min_ratio:
            return []
        down = min(int(math.floor(height / width + 0.5)), int(math.floor(height / min_crop_size)))
        across, down = 1, min(max_num_crops, max(2, down))
    crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
    if min(crop_w, crop_h) < min_crop_size:
        return []
    return [
        (x, y, min(x + crop_w, width), min(y + crop_h, height))
        for y in range(0, crop_h * down, crop_h)
        for x in range(0, crop_w * across, crop_w)
    ]


def _setting(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """A config value; null (how published Gemma 3 configs spell "the processor's default")
    counts as absent."""
    value = config.get(key)
    return default if value is None else value


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """SigLIP preprocessing as Gemma 3 configures it: a square resize, then (x/255 - 0.5) / 0.5.

    Published Gemma 3 checkpoints ask for bilinear resampling (``resample: 2``) at 896 px.
    With ``pan_and_scan`` a wide or tall image is shown as the whole plus a few square-ish
    crops (see ``pan_and_scan_boxes``), each resized like a separate image; the
    ``pan_and_scan_*`` defaults are those of transformers' Gemma3Processor.
    """

    size: int = 896
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD
    pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Gemma3ImageProcessor:
        """From a preprocessor_config.json dict (unknown keys are ignored)."""
        size = config.get("size") or {}
        out = cls(
            size=int(size.get("height", cls.size)) if isinstance(size, Mapping) else int(size),
            resample=int(config.get("resample", cls.resample)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
            pan_and_scan=bool(config.get("do_pan_and_scan")),
            pan_and_scan_min_crop_size=int(_setting(config, "pan_and_scan_min_crop_size", 256)),
            pan_and_scan_max_num_crops=int(_setting(config, "pan_and_scan_max_num_crops", 4)),
            pan_and_scan_min_ratio_to_activate=float(_setting(config, "pan_and_scan_min_ratio_to_activate", 1.2)),
        )
        if out.pan_and_scan_min_crop_size < 1 or out.pan_and_scan_max_num_crops < 2:
            raise MediaError(
                "preprocessor_config.json asks for pan-and-scan crops of under 1 px or fewer than 2 crops; "
                "fix pan_and_scan_min_crop_size / pan_and_scan_max_num_crops or turn do_pan_and_scan off."
            )
        return out

    def settings(self) -> dict[str, Any]:
        """What changes the pixels of one (whole or cropped) image; the crop box is named apart."""
        return {
            "processor": "gemma3",
            "size": self.size,
            "resample": self.resample,
            "rescale_factor": self.rescale_factor,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
        }

    def crop_boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """The pan-and-scan crops of an image this size (empty when pan_and_scan is off)."""
        if not self.pan_and_scan:
            return []
        return pan_and_scan_boxes(
            width,
            height,
            self.pan_and_scan_min_crop_size,
            self.pan_and_scan_max_num_crops,
            self.pan_and_scan_min_ratio_to_activate,
        )

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Images -> pixel_values, float32 (N, 3, size, size); no cropping here (see crop_boxes)."""
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
        raise MediaError(f"Image is {width}x{height}: an aspect ratio above 200:1 cannot be encoded; crop it first.")
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
