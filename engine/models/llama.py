"""Llama 2 / 3.x and Mistral (and the base that Qwen2 and Qwen3 build on).

Covers llama3 / linear / dynamic / yarn RoPE scaling, attention and MLP biases, a
head_dim that differs from hidden/heads, tied embeddings, and Mistral's sliding
window (every layer, when the config sets one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import (
    Attention,
    BaseModelArgs,
    GatedMLP,
    activation,
    attention_mask,
    caches_for,
    layer_types,
    make_rope,
)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "llama"
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int = 32000
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False  # Qwen2/3 switch for their sliding layers
    max_window_layers: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().normalise(config)
        # transformers' MistralConfig defaults to a 4096 window when the key is absent.
        if config.get("model_type") == "mistral" and "sliding_window" not in config:
            config["sliding_window"] = 4096
        return config

    # What differs between the families that share this file's layers.
    qkv_bias = property(lambda self: self.attention_bias)
    o_bias = property(lambda self: self.attention_bias)
    qk_norm = False

    def default_layer_types(self) -> list[str]:
        n = self.num_hidden_layers
        if self.model_type == "mistral" and self.sliding_window:
            return ["sliding_attention"] * n
        if self.use_sliding_window and self.sliding_window:
            first = self.max_window_layers if self.max_window_layers is not None else n
            return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        return ["full_attention"] * n

    def layer_windows(self) -> list[int | None]:
        # Qwen's window only applies when use_sliding_window is on (transformers drops it otherwise).
        if not self.sliding_window or (self.model_type.startswith("qwen") and not self.use_sliding_window):
            return [None] * self.num_hidden_layers
        kinds = layer_types({"layer_types": self.layer_types}, self.num_hidden_layers, self.default_layer_types())
        return [self.sliding_window if k == "sliding_attention" else None for k in kinds]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__()
        rotary_dims = int(args.head_dim * args.partial_rotary_factor)
        rope = make_rope(rotary_dims, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm_eps=args.rms_norm_eps if args.qk_norm else None,
        )
        self.mlp = self.make_mlp(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.window = window

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, activation(args.hidden_act))

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        """Everything after attention: residual, feed-forward, residual."""
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        windows = args.layer_windows()
        self.layers = [self.make_layer(args, i, windows[i]) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return self.layer_class(args, window)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        n = h.shape[1]
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, cache):
            if layer.window not in masks:  # one mask per window size, before any update
                masks[layer.window] = attention_mask(n, c, layer.window)
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks[layer.window], c)
        return self.norm(h)


class Model(nn.Module):
    model_class = LlamaModel

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.model_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings))

    def logits(self, h: mx.array) -> mx.array:
        """Logits from the final (already normalised) hidden states."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def head(self, h: mx.array) -> mx.array:
        """Logits from the last layer's output (final norm included)."""
        return self.logits(self.model.norm(h))

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings exactly as ``__call__`` would use them (for splicing media in)."""
        return self.model.embed_tokens(inputs)

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
