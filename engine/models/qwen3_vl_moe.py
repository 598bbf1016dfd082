"""Qwen3-VL-MoE's language model: Qwen3-VL (interleaved mRoPE, DeepStack; see
``qwen3_vl``) with Qwen3-MoE's sparse expert MLPs, whose router always renormalises the
chosen experts' weights.

Expert weights come fused as ``mlp.experts.gate_up_proj`` / ``down_proj``; the published
checkpoints (and what transformers saves) store them input-major, ``[E, hidden, 2I]`` and
``[E, I, hidden]``, which are turned to the ``[E, out, in]`` stacks MLX runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import qwen2_5_vl, qwen3_moe, qwen3_vl


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    model_type: str = "qwen3_vl_moe"
    rope_theta: float = 500_000.0
    max_position_embeddings: int = 128000
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = True  # the router always renormalises
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        flat, section = qwen2_5_vl.split_mrope(config)
        config = super().normalise(flat)
        config["norm_topk_prob"] = True
        if section is not None:
            config["mrope_section"] = section
        return config


class DecoderLayer(qwen3_vl.DecoderLayer):
    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return qwen3_moe.SparseMoeBlock(args) if args.is_sparse(self.index) else super().make_mlp(args)


class MoeModel(qwen3_vl.Qwen3VLModel):
    layer_class = DecoderLayer


class Model(qwen3_vl.Model):
    model_class = MoeModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        args = self.args
        for name, value in list(weights.items()):
            input_major = (
                name.endswith("mlp.experts.gate_up_proj")
                and value.shape[1:] == (args.hidden_size, 2 * args.moe_intermediate_size)
            ) or (
                name.endswith("mlp.experts.down_proj")
                and value.shape[1:] == (args.moe_intermediate_size, args.hidden_size)
            )
            if input_major:
                weights[name] = value.swapaxes(1, 2)
        return qwen3_moe.stack_experts(super().sanitize(weights), args)
