"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate/up projections.

Also LongRoPE ("longrope"/"su") scaling, a partial rotary factor, and a sliding window
over every layer when the config sets ``sliding_window`` (as transformers does).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import llama
from .base import RoPE, activation, make_rope, sdpa


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "phi3"
    hidden_size: int = 3072
    num_hidden_layers: int = 32
    intermediate_size: int = 8192
    vocab_size: int = 32064
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096

    def default_layer_types(self) -> list[str]:
        kind = "sliding_attention" if self.sliding_window else "full_attention"
        return [kind] * self.num_hidden_layers

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window] * self.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.rope = rope

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        q, k, v = self.qkv(x, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.out(self.attend(q, k, v, mask))

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        b, n, _ = x.shape
        q, k, v = mx.split(self.qkv_proj(x), [self.q_size, self.q_size + self.kv_size], axis=-1)
        q = q.reshape(b, n, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return sdpa(q, k, v, self.scale, mask)

    def out(self, attn: mx.array) -> mx.array:
        b, _, n, _ = attn.shape
        return self.o_proj(attn.transpose(0, 2, 1, 3).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.activation = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__()
        rotary_dims = int(args.head_dim * args.partial_rotary_factor)
        rope = make_rope(rotary_dims, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.self_attn = Attention(args, rope)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.window = window

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(llama.LlamaModel):
    layer_class = DecoderLayer


class Model(llama.Model):
    model_class = Phi3Model
