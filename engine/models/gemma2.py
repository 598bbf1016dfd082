"""Gemma 2 (and the layers Gemma 3 builds on).

What sets Gemma apart: RMSNorm scales by (1 + weight); embeddings are multiplied by
sqrt(hidden_size); attention scores use query_pre_attn_scalar and may be tanh
soft-capped, as may the final logits; each block norms before *and* after both the
attention and the MLP; layers alternate sliding-window (local) and full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import (
    QKV,
    BaseModelArgs,
    GatedMLP,
    RoPE,
    activation,
    attention_mask,
    caches_for,
    layer_types,
    make_rope,
    rotated_qkv,
    sdpa,
    softcapped_attention,
)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma2"
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 256000
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    hidden_activation: str | None = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    tie_word_embeddings: bool = True
    layer_types: list[str] | None = None

    def default_layer_types(self) -> list[str]:
        # Gemma 2: even layers (0, 2, ...) are local.
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]

    def kinds(self) -> list[str]:
        return layer_types({"layer_types": self.layer_types}, self.num_hidden_layers, self.default_layer_types())

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window if k == "sliding_attention" else None for k in self.kinds()]

    def rope_for(self, kind: str) -> RoPE:
        return make_rope(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the stored weight is an offset from 1."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    stacked_projections = (QKV,)

    def __init__(self, args: ModelArgs, rope: RoPE, qk_norm: bool = False):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.scale = float(args.query_pre_attn_scalar) ** -0.5
        self.softcap = args.attn_logit_softcapping
        bias = args.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm:  # Gemma 3
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        q, k, v = self.qkv(x, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.out(self.attend(q, k, v, mask))

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        return rotated_qkv(self, x, offset)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        if self.softcap:
            return softcapped_attention(q, k, v, self.scale, mask, self.softcap)
        return sdpa(q, k, v, self.scale, mask)

    def out(self, attn: mx.array) -> mx.array:
        b, _, n, _ = attn.shape
        return self.o_proj(attn.transpose(0, 2, 1, 3).reshape(b, n, -1))


class DecoderLayer(nn.Module):
    qk_norm = False

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.window = args.sliding_window if kind == "sliding_attention" else None
        self.self_attn = Attention(args, args.rope_for(kind), qk_norm=self.qk_norm)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation=activation(args.hidden_activation))
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(attn_out)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.layer_class(args, kind) for kind in args.kinds()]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.embed_tokens(inputs)
        # transformers rounds the scale to the activation dtype first; so do we.
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        n = h.shape[1]
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, cache):
            if layer.window not in masks:
                masks[layer.window] = attention_mask(n, c, layer.window)
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks[layer.window], c)
        return self.norm(h)


class Model(nn.Module):
    model_class = GemmaModel

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.model_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings))

    def head(self, h: mx.array) -> mx.array:
        """Logits from the last layer's output (final norm included)."""
        return self.logits(self.model.norm(h))

    def logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings as ``__call__`` uses them (already scaled by sqrt(hidden))."""
        return self.model.embed(inputs)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    def make_cache(self) -> list:
        return caches_for([layer.window for layer in self.layers])

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens
