"""LFM2 (Liquid AI): gated short convolutions mixed with grouped-query attention.

A conv layer projects x to (B, C, x'), convolves B * x' causally over the last
``conv_L_cache`` tokens (depthwise, no activation) and multiplies by C; its cache is a
``RecurrentCache`` holding those last inputs. Attention layers have per-head q/k RMSNorm
(``q_layernorm`` / ``k_layernorm``) and full RoPE. The final norm is called
``embedding_norm``. The feed-forward width follows ``block_auto_adjust_ff_dim``: 2/3 of
``block_ff_dim`` (the published spelling of ``intermediate_size``), times
``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``.

Attention layers come from ``layer_types`` (transformers 5) or ``full_attn_idxs`` (the
published configs). Weight names stay Hugging Face's except the feed-forward's
w1/w3/w2, read as gate/up/down (mlx-lm's LFM2-MoE spelling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.base import BaseModelArgs, CausalLM, DecoderStack, GatedMLP, make_rope, sdpa
from engine.models.kv_cache import KVCache
from engine.models.recurrent_cache import RecurrentCache, causal_conv

# HF / mlx-lm spellings of the feed-forward projections -> GatedMLP's.
FFN_NAMES = (
    (".feed_forward.w1.", ".feed_forward.gate_proj."),
    (".feed_forward.w3.", ".feed_forward.up_proj."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "lfm2"
    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    max_position_embeddings: int = 128000
    norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().normalise(config)
        if "tie_embedding" in config:  # the published spelling
            config["tie_word_embeddings"] = config["tie_embedding"]
        if "block_ff_dim" in config:
            config["intermediate_size"] = config["block_ff_dim"]
        return config

    @property
    def rms_norm_eps(self) -> float:  # what DecoderStack's final norm reads
        return self.norm_eps

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_attention(self) -> list[bool]:
        n = self.num_hidden_layers
        if isinstance(self.layer_types, list) and len(self.layer_types) >= n:
            return [k != "conv" for k in self.layer_types[:n]]
        idxs = self.full_attn_idxs if self.full_attn_idxs is not None else range(n)
        return [i in idxs for i in range(n)]

    def ff_dim(self) -> int:
        dim = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            dim = int(2 * dim / 3)
            if self.block_ffn_dim_multiplier is not None:
                dim = int(self.block_ffn_dim_multiplier * dim)
                m = self.block_multiple_of
                dim = m * ((dim + m - 1) // m)
        return dim

    # Memory plan (engine/models/base.py): attention layers grow with the context, conv
    # layers hold conv_L_cache - 1 inputs.
    def layer_windows(self) -> list[int | None]:
        return [None for a in self.is_attention() if a]

    def recurrent_state_bytes(self, dtype_bytes: int) -> int:
        per_layer = (self.conv_L_cache - 1) * self.hidden_size * dtype_bytes
        return per_layer * sum(1 for a in self.is_attention() if not a)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.out_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_layernorm = nn.RMSNorm(d, eps=args.norm_eps)
        self.k_layernorm = nn.RMSNorm(d, eps=args.norm_eps)
        self.rope = make_rope(d, args.rope_theta, args.rope_scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        b, n, _ = x.shape
        q = self.q_layernorm(self.q_proj(x).reshape(b, n, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_layernorm(self.k_proj(x).reshape(b, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.out_proj(sdpa(q, k, v, self.scale, mask).transpose(0, 2, 1, 3).reshape(b, n, -1))


class ShortConv(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.kernel = args.conv_L_cache
        self.in_proj = nn.Linear(h, 3 * h, bias=args.conv_bias)
        self.conv = nn.Conv1d(h, h, self.kernel, groups=h, bias=args.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=args.conv_bias)

    def __call__(self, x: mx.array, mask=None, cache: RecurrentCache | None = None) -> mx.array:
        n = x.shape[1]
        b_gate, c_gate, value = mx.split(self.in_proj(x), 3, axis=-1)
        out, padded = causal_conv(self.conv, b_gate * value, cache, self.kernel)
        if cache is not None:
            if cache.begin(n):  # the conv state after each token, for speculative rollback
                for t in range(1, n):
                    cache.record(t, [padded[:, t : t + self.kernel - 1]])
            cache[0] = padded[:, -(self.kernel - 1) :]
            cache.advance(n)
        return self.out_proj(c_gate * out)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.is_attention_layer = args.is_attention()[index]
        if self.is_attention_layer:
            self.self_attn = Attention(args)
        else:
            self.conv = ShortConv(args)
        self.feed_forward = self.make_feed_forward(args, index)
        self.operator_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.window = None

    @property
    def is_linear(self) -> bool:
        return not self.is_attention_layer

    def make_feed_forward(self, args: ModelArgs, index: int) -> nn.Module:
        return GatedMLP(args.hidden_size, args.ff_dim())

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        mixer = self.self_attn if self.is_attention_layer else self.conv
        h = x + mixer(self.operator_norm(x), mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(DecoderStack):
    layer_class = DecoderLayer

    def make_layers(self, args: ModelArgs) -> list:
        return [self.layer_class(args, i) for i in range(args.num_hidden_layers)]


class Model(CausalLM):
    model_class = Lfm2Model

    def make_cache(self) -> list:
        return [RecurrentCache(1) if layer.is_linear else KVCache() for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if key.startswith("model.embedding_norm."):
                key = "model.norm." + key[len("model.embedding_norm.") :]
            for old, new in FFN_NAMES:
                if old in key:
                    key = key.replace(old, new)
                    break
            if key.endswith("conv.weight") and value.shape[-1] != 1 and value.shape[1] == 1:
                value = value.swapaxes(1, 2)  # Hugging Face's [C, 1, K] -> MLX's [C, K, 1]
            out[key] = value
        return super().sanitize(out)
