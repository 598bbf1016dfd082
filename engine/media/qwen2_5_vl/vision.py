"""Qwen2.5-VL's vision transformer and the prompt it needs.

Patches (C x T x p x p, flattened by the image processor with each 2x2 merge block
contiguous) are embedded by one matmul (the Conv3d of transformers); 2-D rotary
embeddings rotate queries and keys by each patch's (row, column); RMSNorm + SwiGLU
blocks attend within windows of merge units, except the ``fullatt_block_indexes``
blocks, which attend over the whole image; the merger RMS-normalises, concatenates each
2x2 block and projects it (Linear, GELU, Linear) to the language model's width. Tokens
are reordered window by window before the blocks and put back after the merger, as
transformers does. Weights: ``visual.*`` or ``model.visual.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.api import MediaInput
from engine.artifacts.config_fields import from_known_keys
from engine.artifacts.config_spellings import rope_theta_in_parameters
from engine.media.encoded_cache import media_key
from engine.media.image import Qwen2VLImageProcessor, load_image
from engine.media.prompt import PreparedMedia
from engine.media.towers import LazyTowerEncoder, TowerSource, read_image_preprocessor
from engine.models.base import activation

PAD = "<|image_pad|>"
_RENAMES = (("visual.", ""), ("model.visual.", ""))


@dataclass
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    out_hidden_size: int = 2048
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        config = dict(config)
        if "in_chans" in config and "in_channels" not in config:
            config["in_channels"] = config["in_chans"]
        theta = rope_theta_in_parameters(config)
        if theta is not None:
            config["rope_theta"] = theta
        if "fullatt_block_indexes" in config:
            config["fullatt_block_indexes"] = tuple(int(i) for i in config["fullatt_block_indexes"])
        return from_known_keys(cls, config)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = _Kernel((cfg.hidden_size, cfg.in_channels, t, p, p))

    def __call__(self, patches: mx.array) -> mx.array:
        w = self.proj.weight
        return patches.astype(w.dtype) @ w.reshape(w.shape[0], -1).T


class _Kernel(nn.Module):
    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = mx.zeros(shape)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = (cfg.hidden_size // cfg.num_heads) ** -0.5

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array) -> mx.array:
        n, d = x.shape
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).transpose(1, 2, 0, 3)  # each (heads, n, hd)
        dtype = q.dtype
        q32, k32 = q.astype(mx.float32), k.astype(mx.float32)
        q = (q32 * cos + _rotate_half(q32) * sin).astype(dtype)
        k = (k32 * cos + _rotate_half(k32) * sin).astype(dtype)
        out = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale, mask=mask)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, d))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class _MergerMLP(nn.Module):
    def __init__(self, dims: int, out: int):
        super().__init__()
        self.layers = [nn.Linear(dims, dims), nn.GELU(), nn.Linear(dims, out)]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.unit = cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = _MergerMLP(cfg.hidden_size * self.unit, cfg.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.mlp(self.ln_q(x).reshape(-1, x.shape[-1] * self.unit))


def vision_positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """(t*h*w, 2) (row, column) of each patch, in the processor's merge-block order."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Merge units reordered window by window, and each window's length in patches."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    order: list[np.ndarray] = []
    lengths: list[int] = []
    for frame in range(t):
        for r in range(0, gh, window):
            for c in range(0, gw, window):
                part = index[frame, r : r + window, c : c + window].reshape(-1)
                if part.size:
                    order.append(part)
                    lengths.append(int(part.size) * merge * merge)
    return np.concatenate(order), lengths


def _segment_mask(lengths: list[int]) -> mx.array:
    ids = np.repeat(np.arange(len(lengths)), lengths)
    return mx.array(ids[:, None] == ids[None, :])


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = [Block(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        quarter = head_dim // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def __call__(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """One image's patches (t*h*w, C*T*p*p) -> (t*h*w / merge^2, out_hidden)."""
        cfg = self.config
        m, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        t, h, w = grid
        n = t * h * w
        order, windows = window_order(grid, m, cfg.window_size // m // cfg.patch_size)
        pos = vision_positions(grid, m).astype(np.float32)
        angles = np.concatenate([pos[:, :1] * self._inv_freq, pos[:, 1:] * self._inv_freq], axis=-1)
        angles = angles.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = mx.array(np.cos(angles)), mx.array(np.sin(angles))
        window_mask = _segment_mask(windows)
        full_mask = _segment_mask([h * w] * t)

        x = self.patch_embed(patches)
        x = x.reshape(n // unit, unit, -1)[mx.array(order)].reshape(n, -1)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_mask if i in cfg.fullatt_block_indexes else window_mask)
        merged = self.merger(x)
        return merged[mx.array(np.argsort(order))]


def sanitize(weights: dict[str, mx.array], cfg: VisionConfig) -> dict[str, mx.array]:
    """transformers' ``merger.mlp.0/2`` are our ``merger.mlp.layers.0/2``; an MLX-layout
    (O, T, p, p, C) patch kernel goes back to (O, C, T, p, p)."""
    out = {}
    for name, value in weights.items():
        if name.startswith("merger.mlp."):
            name = "merger.mlp.layers." + name[len("merger.mlp.") :]
        if name == "patch_embed.proj.weight" and value.ndim == 5 and value.shape[1] != cfg.in_channels:
            value = value.transpose(0, 4, 1, 2, 3)
        out[name] = value
    return out


class QwenVisionEncoder(LazyTowerEncoder):
    kind = "image"
    placeholder = PAD
    renames = _RENAMES
    what = "Qwen2.5-VL vision tower"

    def __init__(self, source: TowerSource):
        raw = source.config.raw
        self.source = source
        self.config = VisionConfig.from_dict(raw.get("vision_config") or {})
        self.token_id = int(raw.get("image_token_id", source.config.text.get("image_token_id", 151655)))
        pre = read_image_preprocessor(source)
        pre.setdefault("patch_size", self.config.patch_size)
        pre.setdefault("merge_size", self.config.spatial_merge_size)
        pre.setdefault("temporal_patch_size", self.config.temporal_patch_size)
        self.processor = Qwen2VLImageProcessor.from_config(pre)
        self.module: VisionTransformer | None = None
        self.calls = 0

    def prepare(self, item: MediaInput) -> PreparedMedia:
        image = load_image(item.source)
        vision = self.processor([image])
        t, h, w = (int(v) for v in vision.image_grid_thw[0])
        m = self.processor.merge_size
        n = t * h * w // (m * m)
        settings = {**self.processor.settings(), "model": str(self.source.path), "tower": "qwen2_5_vl"}
        return PreparedMedia(
            kind="image",
            key=media_key(item, settings),
            n_tokens=n,
            text=PAD * n,
            data=(vision.pixel_values, (t, h, w)),
            grid=(t, h // m, w // m),
        )

    def build(self) -> VisionTransformer:
        return VisionTransformer(self.config)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return sanitize(weights, self.config)

    def run(self, module: VisionTransformer, item: PreparedMedia) -> mx.array:
        pixels, grid = item.data
        return module(mx.array(pixels), grid)


def make_encoder(source: TowerSource) -> QwenVisionEncoder:
    return QwenVisionEncoder(source)
