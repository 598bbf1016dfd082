"""Qwen2.5-VL's language model: Qwen2 with multimodal RoPE (mRoPE).

Each token has three position ids (time, height, width). The rotary frequencies are
split into ``mrope_section`` groups, each rotated by one of the three ids. Text tokens
carry the same id three times, which is plain RoPE, so a text-only prompt runs exactly
as Qwen2 does. An image's tokens take (start, start + row, start + column) and the text
after it continues from start + max(rows, columns); ``rope_index`` computes this for a
whole prompt (transformers' get_rope_index), and decode steps continue at the cache
offset plus the prompt's delta. Weights: ``model.*`` or ``model.language_model.*``
(transformers >= 4.52); the ``visual`` tower is left to engine/media.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts import config_spellings
from engine.models import llama, qwen2
from engine.models.base import Attention, RoPE, strip_prefixes, text_config


@dataclass
class ModelArgs(qwen2.ModelArgs):
    model_type: str = "qwen2_5_vl"
    vocab_size: int = 152064
    max_position_embeddings: int = 128000
    rope_theta: float = 1_000_000.0
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        flat, section = split_mrope(config)
        config = super().normalise(flat)
        if section is not None:
            config["mrope_section"] = section
        return config


def split_mrope(config: dict[str, Any]) -> tuple[dict[str, Any], list[int] | None]:
    """(the flattened text config with mRoPE taken out of its RoPE block, mrope_section or
    None): mRoPE is handled by the attention here; what remains for the shared reader is
    plain RoPE."""
    flat = text_config(config)
    section = config_spellings.mrope_section(flat)
    for key in ("rope_parameters", "rope_scaling"):
        block = flat.get(key)
        if isinstance(block, dict) and (block.get("rope_type") or block.get("type")) in ("mrope", "default", None):
            theta = block.get("rope_theta")
            flat[key] = None
            if theta is not None:
                flat["rope_theta"] = theta
    return flat, section


def mrope_axes(section: Sequence[int], half: int, interleaved: bool) -> np.ndarray:
    """For each of the ``half`` rotary frequencies, which position id (0 time, 1 height,
    2 width) rotates it. Qwen2.5-VL gives each id a contiguous block of ``section``
    frequencies; Qwen3-VL interleaves them (t, h, w, t, h, w, ...), the height ids taking
    frequencies 1, 4, ... below 3 * section[1], the width ids 2, 5, ... below 3 * section[2]."""
    if not interleaved:
        return np.repeat(np.arange(3) % 3, section)[:half].astype(np.int32)
    axes = np.zeros(half, dtype=np.int32)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def rotate_mrope(x: mx.array, positions: mx.array, axes: mx.array, inv_freq: mx.array) -> mx.array:
    """Rotate the first ``2 * len(inv_freq)`` features of x (b, heads, n, d) in the
    rotate-half layout, frequency i by position id ``axes[i]`` of positions (3, b, n);
    features past them pass through (partial rotary, as Qwen3.5 has)."""
    pos = positions.astype(mx.float32)  # (3, b, n)
    chosen = mx.take(pos, axes, axis=0)  # (half, b, n)
    angles = chosen.transpose(1, 2, 0) * inv_freq  # (b, n, half)
    angles = mx.concatenate([angles, angles], axis=-1)[:, None]  # (b, 1, n, dims)
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    dims = angles.shape[-1]
    head = x[..., :dims] if dims < x.shape[-1] else x
    half = dims // 2
    rotated = mx.concatenate([-head[..., half:], head[..., :half]], axis=-1)
    out = head * cos + rotated * sin
    return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)


class MRoPEAttention(Attention):
    """Qwen2 (Qwen3: with per-head norms) attention whose rotation takes explicit
    (3, 1, n) position ids when given."""

    def __init__(self, *args: Any, mrope_section: Sequence[int], base: float, interleaved: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        half = self.head_dim // 2
        inv = 1.0 / (base ** (np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim))
        # For each frequency, which of the three position ids rotates it.
        self._axis = mx.array(mrope_axes(mrope_section, half, interleaved))
        self._inv_freq = mx.array(inv)

    def rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """x (b, heads, n, d); positions (3, b, n)."""
        return rotate_mrope(x, positions, self._axis, self._inv_freq)

    def __call__(self, x: mx.array, mask, cache, position_ids: mx.array | None = None) -> mx.array:
        if position_ids is None:
            return super().__call__(x, mask, cache)
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        q, k = self.rotate(q, position_ids), self.rotate(k, position_ids)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.out(self.attend(q, k, v, mask))


class DecoderLayer(llama.DecoderLayer):
    interleaved = False  # Qwen3-VL's layout of the mRoPE frequencies

    def make_attention(self, args: ModelArgs, rope: RoPE) -> nn.Module:
        return MRoPEAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm_eps=args.rms_norm_eps if args.qk_norm else None,
            mrope_section=args.mrope_section,
            base=args.rope_theta,
            interleaved=self.interleaved,
        )

    def __call__(self, x: mx.array, mask, cache, position_ids: mx.array | None = None) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache, position_ids))


class QwenVLModel(llama.LlamaModel):
    layer_class = DecoderLayer

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        return self.run(inputs, cache, input_embeddings, position_ids=position_ids)


_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
)
_TOWER = ("visual.", "model.visual.")


class Model(llama.Model):
    model_class = QwenVLModel

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings, position_ids))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(strip_prefixes(weights, _PREFIXES, _TOWER))

    @staticmethod
    def rope_index(ids: Sequence[int], media: Sequence[tuple[int, int, tuple[int, int, int] | None]]) -> np.ndarray:
        """(3, len(ids)) position ids; ``media`` holds (start, end, (t, h, w) in LM tokens)."""
        out = np.zeros((3, len(ids)), dtype=np.int64)
        cursor = pos = 0
        for start, end, grid in sorted(media, key=lambda m: m[0]):
            out[:, cursor:start] = np.arange(start - cursor) + pos
            pos += start - cursor
            if grid is None:  # media without a spatial grid (audio): plain positions
                out[:, start:end] = np.arange(end - start) + pos
                pos += end - start
            else:
                t, h, w = grid
                if t * h * w != end - start:
                    raise ValueError(f"grid {grid} does not cover {end - start} tokens")
                tt, hh, ww = np.meshgrid(np.zeros(t, dtype=np.int64), np.arange(h), np.arange(w), indexing="ij")
                out[:, start:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
                pos += max(h, w)
            cursor = end
        out[:, cursor:] = np.arange(len(ids) - cursor) + pos
        return out
