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

from engine.models import base
from engine.models.base import (
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    GatedMLP,
    RoPE,
    activation,
    layer_types,
    make_rope,
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


class Attention(base.Attention):
    norm_class = RMSNorm

    def __init__(self, args: ModelArgs, rope: RoPE, qk_norm: bool = False):
        bias = args.attention_bias
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_eps=args.rms_norm_eps if qk_norm else None,  # qk norms: Gemma 3
            scale=float(args.query_pre_attn_scalar) ** -0.5,
        )
        self.softcap = args.attn_logit_softcapping

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        if self.softcap:
            return softcapped_attention(q, k, v, self.scale, mask, self.softcap)
        return super().attend(q, k, v, mask)


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


class GemmaModel(DecoderStack):
    layer_class = DecoderLayer
    norm_class = RMSNorm

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.args = args

    def make_layers(self, args: ModelArgs) -> list:
        return [self.layer_class(args, kind) for kind in args.kinds()]

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings scaled by sqrt(hidden), as ``__call__`` uses them."""
        h = self.embed_tokens(inputs)
        # transformers rounds the scale to the activation dtype first; so do we.
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)


class Model(CausalLM):
    model_class = GemmaModel

    @property
    def logit_softcap(self) -> float | None:
        return self.args.final_logit_softcapping
