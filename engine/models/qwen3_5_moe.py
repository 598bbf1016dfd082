"""Qwen3.5-MoE (text part): Qwen3.5's hybrid layers with a sparse MoE block in every layer,
routed experts (top-k always renormalised) plus a shared expert gated by sigmoid.

Experts load from either Hugging Face spelling (fused ``experts.gate_up_proj``, as the
published checkpoints store them, or one module per expert) and from mlx-lm's stacked
``switch_mlp`` layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from engine.models import qwen3_5
from engine.models.qwen3_next import SharedExpertMoeBlock


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe_text"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().normalise(config)
        # transformers' Qwen3.5-MoE has no such settings: every layer sparse, weights renormalised.
        config.update(norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1)
        return config


class DecoderLayer(qwen3_5.DecoderLayer):
    def make_mlp(self, args: ModelArgs, index: int) -> nn.Module:
        return SharedExpertMoeBlock(args)


class MoeModel(qwen3_5.HybridModel):
    layer_class = DecoderLayer


class Model(qwen3_5.Model):
    model_class = MoeModel


resident_weight = qwen3_5.resident_weight  # its MTP layer loads as Qwen3.5's does
