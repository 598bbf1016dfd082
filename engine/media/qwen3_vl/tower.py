"""Qwen3-VL's vision tower (images and video frames) and its DeepStack features.

Patches (C x T x p x p, flattened by the processor with each merge block contiguous)
are embedded by one matmul plus bias (transformers' Conv3d). A learned square table of
position embeddings is resampled to each grid bilinearly (align_corners, as
transformers' ``get_vision_interpolation_indices_and_weights``) and added; 2-D rotary
embeddings rotate queries and keys by each patch's (row, column), as in Qwen2.5-VL.
LayerNorm + GELU-MLP blocks attend within each frame. The merger LayerNorms, joins each
merge block and projects it (Linear, GELU, Linear); the DeepStack mergers do the same
to the outputs of ``deepstack_visual_indexes`` blocks, normalising after the join.

The output of one image or frame group is ``(tokens, out_hidden * (1 + k))``: the merged
features, then the k DeepStack features, side by side (engine/models/qwen3_vl.py splits
them). Weights: ``visual.*``, ``model.visual.*`` or (mlx-vlm) ``vision_tower.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts.config_fields import from_known_keys
from engine.media.qwen2_5_vl.vision import Attention, _segment_mask, vision_positions
from engine.models.base import activation

# transformers: (model.)visual.*; mlx-vlm conversions (mlx-community): vision_tower.*
RENAMES = (("visual.", ""), ("model.visual.", ""), ("vision_tower.", ""))


@dataclass
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    out_hidden_size: int = 3584
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        config = dict(config)
        params = config.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" in params:
            config["rope_theta"] = params["rope_theta"]
        for spelling, name in (("num_hidden_layers", "depth"), ("num_attention_heads", "num_heads")):
            if spelling in config and name not in config:
                config[name] = config[spelling]
        if "deepstack_visual_indexes" in config:
            config["deepstack_visual_indexes"] = tuple(int(i) for i in config["deepstack_visual_indexes"])
        return from_known_keys(cls, config)


def interpolation(grid: tuple[int, int, int], side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners) taps into the ``side`` x ``side`` position table for each
    patch, in merge-block order: indices and weights, each (t*h*w, 4), float32 as in
    transformers."""
    _, h, w = grid
    pos = vision_positions(grid, merge)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2, dtype=np.float32)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets.astype(np.int64), 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32)
        return taps, weights

    h_taps, h_weights = axis(pos[:, 0], h)
    w_taps, w_weights = axis(pos[:, 1], w)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class _Conv(nn.Module):
    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = mx.zeros(shape)
        self.bias = mx.zeros((shape[0],))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = _Conv((cfg.hidden_size, cfg.in_channels, t, p, p))

    def __call__(self, patches: mx.array) -> mx.array:
        w = self.proj.weight
        return patches.astype(w.dtype) @ w.reshape(w.shape[0], -1).T + self.proj.bias


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, join each merge block, Linear-GELU-Linear. ``after_join`` (the DeepStack
    mergers) normalises the joined vector instead of each patch."""

    def __init__(self, cfg: VisionConfig, after_join: bool = False):
        super().__init__()
        self.joined = cfg.hidden_size * cfg.spatial_merge_size**2
        self.after_join = after_join
        self.norm = nn.LayerNorm(self.joined if after_join else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.joined, self.joined)
        self.linear_fc2 = nn.Linear(self.joined, cfg.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x.reshape(-1, self.joined)) if self.after_join else self.norm(x).reshape(-1, self.joined)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [Block(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg)
        self.deepstack_merger_list = [PatchMerger(cfg, after_join=True) for _ in cfg.deepstack_visual_indexes]
        quarter = cfg.hidden_size // cfg.num_heads // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
        self._side = int(cfg.num_position_embeddings**0.5)

    def __call__(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """One image's (or frame group's) patches (t*h*w, C*T*p*p) -> (t*h*w / merge^2,
        out_hidden * (1 + DeepStack features))."""
        cfg = self.config
        t, h, w = grid
        pos = vision_positions(grid, cfg.spatial_merge_size).astype(np.float32)
        angles = np.concatenate([pos[:, :1] * self._inv_freq, pos[:, 1:] * self._inv_freq], axis=-1)
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = mx.array(np.cos(angles)), mx.array(np.sin(angles))
        mask = _segment_mask([h * w] * t) if t > 1 else None  # each frame attends to itself

        indices, weights = interpolation(grid, self._side, cfg.spatial_merge_size)
        table = self.pos_embed(mx.array(indices))  # (n, 4, hidden)
        x = self.patch_embed(patches)
        x = x + (table * mx.array(weights)[:, :, None].astype(table.dtype)).sum(axis=1).astype(x.dtype)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)]
                features.append(merger(x))
        return mx.concatenate([self.merger(x), *features], axis=-1)


def sanitize(weights: dict[str, mx.array], cfg: VisionConfig) -> dict[str, mx.array]:
    """An MLX-layout (O, T, p, p, C) patch kernel goes back to (O, C, T, p, p)."""
    out = {}
    for name, value in weights.items():
        if name == "patch_embed.proj.weight" and value.ndim == 5 and value.shape[1] != cfg.in_channels:
            value = value.transpose(0, 4, 1, 2, 3)
        out[name] = value
    return out
