"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate/up projections.

Also LongRoPE ("longrope"/"su") scaling, a partial rotary factor, and a sliding window
over every layer when the config sets ``sliding_window`` (as transformers does).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.models import llama
from engine.models.base import AttentionSteps, RoPE, activation


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


class Attention(AttentionSteps):
    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.rope = rope

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        b, n, _ = x.shape
        q, k, v = mx.split(self.qkv_proj(x), [self.q_size, self.q_size + self.kv_size], axis=-1)
        q = q.reshape(b, n, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.activation = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(llama.DecoderLayer):
    def make_attention(self, args: ModelArgs, rope: RoPE) -> nn.Module:
        return Attention(args, rope)

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return MLP(args)


class Phi3Model(llama.LlamaModel):
    layer_class = DecoderLayer


class Model(llama.Model):
    model_class = Phi3Model
