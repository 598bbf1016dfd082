"""Gemma 4's image and audio preprocessing, as transformers' Gemma4ImageProcessorPil and
Gemma4AudioFeatureExtractor do it. No MLX here.

Images: the soft-token budget (``max_soft_tokens``, one of 70/140/280/560/1120) sets a
patch budget (budget x pooling_kernel_size^2 patches); the image is resized with Pillow
(bicubic), aspect kept, to the largest size within it whose sides are whole pooling
blocks (pooling_kernel_size x patch_size pixels), rescaled to [0, 1] (no normalisation:
the tower maps it to [-1, 1] itself) and cut into patches, each flattened row by row with
the channels last, with its (column, row) position. Each image therefore brings its own
number of soft tokens: (rows / k) x (columns / k).

Audio: 16 kHz mono, zero-padded at the end to a multiple of 128 samples; frames of 20 ms
every 10 ms after ``frame_length // 2`` zeros in front (semicausal), a periodic Hann
window, a 512-point FFT magnitude, 128 HTK-mel filters (no normalisation) from 0 to
8 kHz, log(mel + 0.001). A frame counts only when its whole window holds real samples;
the others are zeroed. The tower's two stride-2 convolutions then give one soft token
per 4 frames (40 ms).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import MediaError
from engine.media.image_processors import _check_rgb, _rescale_normalize

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class VisionInput:
    patches: np.ndarray  # float32 (n_patches, patch * patch * 3), pixels in [0, 1]
    positions: np.ndarray  # int32 (n_patches, 2): (column, row) of each patch
    soft_tokens: int


def target_size(height: int, width: int, patch: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """transformers' get_aspect_ratio_preserving_size: the largest (height, width) in whole
    pooling blocks within the patch budget, aspect kept."""
    if min(height, width) <= 0:
        raise MediaError(f"Image has no pixels ({width}x{height}).")
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = kernel * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // kernel**2) * side
    if h == 0 and w == 0:
        raise MediaError(f"The image ({width}x{height}) is too small for Gemma 4's vision tower.")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    return h, w


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Gemma4ImageProcessor:
        budget = int(config.get("max_soft_tokens", cls.max_soft_tokens))
        if budget not in SOFT_TOKEN_BUDGETS:
            raise MediaError(
                f"Gemma 4's max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, the model's "
                f"processor config says {budget}; download the model again."
            )
        if config.get("do_normalize"):
            raise MediaError(
                "This Gemma 4 processor config normalises pixels, which Gemma 4 was not trained "
                "with; download the model's processor config again."
            )
        return cls(
            patch_size=int(config.get("patch_size", cls.patch_size)),
            max_soft_tokens=budget,
            pooling_kernel_size=int(config.get("pooling_kernel_size", cls.pooling_kernel_size)),
            resample=int(config.get("resample", cls.resample)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
        )

    def settings(self) -> dict[str, Any]:
        return {"processor": "gemma4", **asdict(self)}

    def __call__(self, image: Image.Image) -> VisionInput:
        rgb = _check_rgb(image)
        p, k = self.patch_size, self.pooling_kernel_size
        h, w = target_size(rgb.height, rgb.width, p, self.max_soft_tokens * k * k, k)
        if (h, w) != (rgb.height, rgb.width):
            rgb = rgb.resize((w, h), resample=self.resample)
        pixels = _rescale_normalize(rgb, self.rescale_factor, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
        rows, cols = h // p, w // p
        patches = pixels.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        positions = np.stack([x, y], axis=-1).reshape(-1, 2).astype(np.int32)
        return VisionInput(np.ascontiguousarray(patches), positions, rows * cols // (k * k))


# ---- audio -------------------------------------------------------------------------


def _hz_to_mel_htk(hz: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def _mel_to_hz_htk(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (np.power(10.0, np.asarray(mel, dtype=np.float64) / 2595.0) - 1.0)


def htk_mel_filters(n_bins: int, n_mels: int, f_min: float, f_max: float, sample_rate: int) -> np.ndarray:
    """Triangular filters on the HTK mel scale, unnormalised, (n_bins, n_mels) float64:
    transformers' mel_filter_bank(norm=None, mel_scale="htk")."""
    edges = _mel_to_hz_htk(np.linspace(_hz_to_mel_htk(f_min), _hz_to_mel_htk(f_max), n_mels + 2))
    fft_hz = np.linspace(0, sample_rate // 2, n_bins)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_hz[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


@dataclass(frozen=True)
class Gemma4AudioFeatures:
    feature_size: int = 128
    sampling_rate: int = 16000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    max_samples: int = 480_000  # 30 s: what the processor keeps of a clip (it cuts the rest)
    pad_to_multiple_of: int = 128

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Gemma4AudioFeatures:
        for key, neutral in (
            ("preemphasis", 0.0),
            ("dither", 0.0),
            ("input_scale_factor", 1.0),
            ("fft_overdrive", False),
            ("per_bin_mean", None),
            ("per_bin_stddev", None),
        ):
            if config.get(key, neutral) != neutral:
                raise MediaError(
                    f"This Gemma 4 audio preprocessor sets {key}={config[key]!r}, which MLX Desk "
                    "does not mirror; use the model's published preprocessor config."
                )
        fields = {
            k: config[k]
            for k in (
                "feature_size",
                "sampling_rate",
                "frame_length_ms",
                "hop_length_ms",
                "min_frequency",
                "max_frequency",
                "mel_floor",
            )
            if config.get(k) is not None
        }
        return cls(**{k: type(getattr(cls, k))(v) for k, v in fields.items()})

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    def settings(self) -> dict[str, Any]:
        return {"processor": "gemma4-audio", **asdict(self)}

    def cut_note(self, samples: int) -> str:
        """The line saying a clip of ``samples`` was cut to what Gemma 4 hears ("" when not)."""
        if samples <= self.max_samples:
            return ""
        rate = self.sampling_rate
        return (
            f"An audio clip of {samples / rate:.0f} s is longer than Gemma 4 hears: only its first "
            f"{self.max_samples / rate:.0f} s were heard (cut it into parts, or transcribe it, for the rest)."
        )

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """16 kHz mono samples -> (log-mel features float32 (frames, mels), valid-frame mask).
        A clip longer than ``max_samples`` is cut there, as Gemma4AudioFeatureExtractor's
        default truncation does (``heard`` says how much of a clip that is)."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise MediaError("The audio clip is empty.")
        x = x[: self.max_samples]
        m = self.pad_to_multiple_of
        n = x.shape[0]
        padded = np.pad(x, (0, -(-n // m) * m - n))
        real = np.zeros(padded.shape[0], dtype=np.int32)
        real[:n] = 1
        length = self.frame_length
        left = length // 2
        padded = np.pad(padded, (left, 0))
        real = np.pad(real, (left, 0))
        size, hop = length + 1, self.hop_length
        count = (padded.shape[0] - size) // hop + 1
        if count <= 0:
            raise MediaError("The audio clip is too short to hear (under 20 ms).")
        frames = np.lib.stride_tricks.sliding_window_view(padded, size)[::hop][:count][:, :-1]
        window = np.hanning(length + 1)[:-1].astype(np.float32)  # periodic Hann
        fft_length = 2 ** math.ceil(math.log2(length))
        magnitude = np.abs(np.fft.rfft(frames * window, n=fft_length, axis=-1))
        filters = htk_mel_filters(
            fft_length // 2 + 1, self.feature_size, self.min_frequency, self.max_frequency, self.sampling_rate
        )
        log_mel = np.log(magnitude @ filters + np.array(self.mel_floor, dtype=np.float64)).astype(np.float32)
        mask = real[np.arange(count) * hop + size - 1].astype(bool)
        return log_mel * mask[:, None], mask


def audio_soft_tokens(mask: np.ndarray) -> int:
    """Soft tokens for a clip: its valid frames after the tower's two stride-2 convolutions
    (Gemma4Processor's count)."""
    for _ in range(2):
        mask = mask[::2]
    return int(mask.sum())
