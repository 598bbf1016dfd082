"""Qwen3-Next: Qwen3.5's hybrid layout (gated DeltaNet + gated attention, (1 + w) norms)
with the linear projections interleaved per key head, and sparse MoE blocks whose
output adds a shared expert gated by sigmoid(shared_expert_gate(x)).

``in_proj_qkvz`` holds, for each key head in turn, its query, its key, then the values and
z of the value heads it serves; ``in_proj_ba`` likewise b then a. Layers are sparse unless
listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` rhythm; the router
renormalises its top-k weights when ``norm_topk_prob``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.models import qwen3_5, qwen3_moe, stacked
from engine.models.base import GatedMLP, activation
from engine.models.gated_delta import GatedDeltaNet

# A DeltaNet layer's projections of the same input (one matmul once stacked).
IN_PROJ = ("in_proj_qkvz", "in_proj_ba")
# The router and the shared expert's gate read the same input too.
ROUTER_GATES = ("gate", "shared_expert_gate")


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_next"
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    vocab_size: int = 151936
    linear_num_value_heads: int = 32
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512


class SharedExpertMoeBlock(qwen3_moe.SparseMoeBlock):
    """Routed experts (softmax router, top-k) plus an always-on shared expert, gated."""

    stacked_projections = (ROUTER_GATES,)

    def __init__(self, args: qwen3_5.ModelArgs):
        super().__init__(args)
        act = activation(args.hidden_act)
        self.shared_expert = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, activation=act)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        router_logits, shared_gate = stacked.project(self, ROUTER_GATES, x)
        return self.experts(x, router_logits) + mx.sigmoid(shared_gate) * self.shared_expert(x)


class NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: q, k, v, z interleaved per key head; b, a likewise."""

    stacked_projections = (IN_PROJ,)

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size,
            args.linear_num_key_heads,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            args.linear_conv_kernel_dim,
            args.rms_norm_eps,
            activation(args.hidden_act),
        )
        self.in_proj_qkvz = nn.Linear(args.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(args.hidden_size, 2 * self.num_v_heads, bias=False)

    def project(self, x: mx.array):
        b, n, _ = x.shape
        nk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        per = self.num_v_heads // nk  # value heads per key head
        qkvz, ba = stacked.project(self, IN_PROJ, x)
        q, k, v, z = mx.split(qkvz.reshape(b, n, nk, 2 * dk + 2 * per * dv), [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
        beta, a = mx.split(ba.reshape(b, n, nk, 2 * per), [per], axis=-1)
        qkv = mx.concatenate([q.reshape(b, n, -1), k.reshape(b, n, -1), v.reshape(b, n, -1)], axis=-1)
        nv = self.num_v_heads
        return qkv, z.reshape(b, n, nv, dv), beta.reshape(b, n, nv), a.reshape(b, n, nv)


class DecoderLayer(qwen3_5.DecoderLayer):
    linear_class = NextGatedDeltaNet

    def make_mlp(self, args: ModelArgs, index: int) -> nn.Module:
        if args.is_sparse(index):
            return SharedExpertMoeBlock(args)
        return super().make_mlp(args, index)


class NextModel(qwen3_5.HybridModel):
    layer_class = DecoderLayer


class Model(qwen3_5.Model):
    model_class = NextModel


resident_weight = qwen3_5.resident_weight  # its MTP layer loads as Qwen3.5's does
