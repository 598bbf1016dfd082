"""LFM2-MoE: LFM2's conv + attention layers with sparse feed-forward blocks after the first
``num_dense_layers``.

The router scores experts with sigmoid(gate(x)); with ``use_expert_bias`` the top-k are
chosen on scores + ``expert_bias`` while the weights stay the unbiased scores. Weights
are renormalised (``norm_topk_prob``, + 1e-6 as transformers does) and scaled by
``routed_scaling_factor``. Dense layers use ``intermediate_size`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.models import lfm2
from engine.models.base import GatedMLP
from engine.models.switch import SwitchGLU, stack_expert_weights, top_k_ids


@dataclass
class ModelArgs(lfm2.ModelArgs):
    model_type: str = "lfm2_moe"
    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_dense_layers: int = 2
    num_experts: int = 32
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.use_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        scores, ranked = self._scores(x)
        chosen = top_k_ids(ranked, self.top_k)
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
        weights = weights * self.scaling
        y = self.switch_mlp(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def _scores(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(each expert's weight, the score its choice ranks by)."""
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        return scores, (scores + self.expert_bias.astype(mx.float32) if "expert_bias" in self else scores)

    def choose_experts(self, x: mx.array) -> mx.array:
        return top_k_ids(self._scores(x)[1], self.top_k)


class DecoderLayer(lfm2.DecoderLayer):
    def make_feed_forward(self, args: ModelArgs, index: int) -> nn.Module:
        if index < args.num_dense_layers:
            return GatedMLP(args.hidden_size, args.intermediate_size)
        return SparseMoeBlock(args)


class MoeModel(lfm2.Lfm2Model):
    layer_class = DecoderLayer


class Model(lfm2.Model):
    model_class = MoeModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_dense_layers, self.args.num_hidden_layers):
            stack_expert_weights(weights, f"model.layers.{i}.feed_forward", self.args.num_experts)
        return weights
