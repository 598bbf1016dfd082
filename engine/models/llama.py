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

from engine.models import l2_ahead_cuda, layer_tail_cuda
from engine.models.base import (
    GATE_UP,
    Attention,
    AttentionSteps,
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    GatedMLP,
    RoPE,
    activation,
    heads_as_rows,
    layer_types,
    make_rope,
)
from engine.models.stacked import packed_stack


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


def _affine_quantized(module) -> bool:
    return type(module) is nn.QuantizedLinear and getattr(module, "mode", "affine") == "affine" and "biases" in module


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__()
        rotary_dims = int(args.head_dim * args.partial_rotary_factor)
        rope = make_rope(rotary_dims, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.self_attn = self.make_attention(args, rope)
        self.mlp = self.make_mlp(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.window = window

    def make_attention(self, args: ModelArgs, rope: RoPE) -> nn.Module:
        return Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm_eps=args.rms_norm_eps if args.qk_norm else None,
        )

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, activation(args.hidden_act))

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        """Everything after attention: residual, feed-forward, residual."""
        return self.feed_forward(x + attn_out)

    def feed_forward(self, h: mx.array) -> mx.array:
        """``h`` plus the feed-forward of its norm."""
        if type(self.mlp) is GatedMLP:  # the norm and the last add inside the products on CUDA
            return self.mlp.plus(h, h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))

    def weights_after_attention(self, x: mx.array) -> list[mx.array]:
        """The weights, scales and biases this layer's products read after attention, in their
        order: the output product's and the stacked gate/up product's, and the down product's
        where ``MLX_DESK_L2_AHEAD=2`` asks (models.l2_ahead_cuda asks L2 for them while
        attention runs); none unless each is a plain affine quantized layer and gate and up
        are stacked."""
        o_proj, mlp = getattr(self.self_attn, "o_proj", None), self.mlp
        down = getattr(mlp, "down_proj", None)
        if type(mlp) is not GatedMLP or not all(_affine_quantized(m) for m in (o_proj, down)):
            return []
        gate_up = packed_stack(mlp, GATE_UP, x)
        if gate_up is None:
            return []
        arrays = [o_proj.weight, o_proj.scales, o_proj.biases, *gate_up]
        if l2_ahead_cuda.level() > 1:
            arrays += [down.weight, down.scales, down.biases]
        return arrays

    def finish_attention(self, x: mx.array, attn: mx.array) -> mx.array:
        """``finish(x, self.self_attn.out(attn))`` from the attention before its output
        product, so that the first residual add can run in that product's epilogue on CUDA
        (a compiled decode step calls this); layers with their own ``finish`` keep it."""
        out_plus = getattr(self.self_attn, "out_plus", None)  # attention built on AttentionSteps
        if out_plus is None or type(self).finish is not DecoderLayer.finish:
            return self.finish(x, self.self_attn.out(attn))
        tail = self.tail_in_one_launch(attn, x)
        if tail is not None:
            return tail
        return self.feed_forward(out_plus(attn, x))

    def tail_in_one_launch(self, attn: mx.array, x: mx.array) -> mx.array | None:
        """``feed_forward(x + out(attn))`` in one CUDA launch (models.layer_tail_cuda) where it
        is turned on and takes this layer: the plain output step, a SiLU MLP whose gate and up
        are stacked, quantized layers without adapters; None otherwise."""
        if not layer_tail_cuda.enabled() or type(self.self_attn).out is not AttentionSteps.out:
            return None
        mlp = self.mlp
        if type(mlp) is not GatedMLP or mlp.activation is not nn.silu:
            return None
        rows = heads_as_rows(attn)
        gate_up = packed_stack(mlp, GATE_UP, x)
        norm, o_proj = self.post_attention_layernorm, self.self_attn.o_proj
        if gate_up is None or not layer_tail_cuda.takes(rows, x, o_proj, norm, gate_up, mlp.down_proj):
            return None
        return layer_tail_cuda.layer_tail(rows, x, o_proj, norm, gate_up, mlp.down_proj, self)


class LlamaModel(DecoderStack):
    layer_class = DecoderLayer

    def make_layers(self, args: ModelArgs) -> list:
        windows = args.layer_windows()
        return [self.make_layer(args, i, windows[i]) for i in range(args.num_hidden_layers)]

    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return self.layer_class(args, window)


class Model(CausalLM):
    model_class = LlamaModel
