"""Qwen3-MoE: Qwen3 attention with sparse expert MLPs (softmax router, top-k experts).

A layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``
rhythm. Experts are stacked at load time into ``mlp.switch_mlp`` (the layout MLX
checkpoints use), so quantized MoE checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.models import llama
from engine.models.base import activation
from engine.models.switch import SwitchGLU, stack_expert_weights, top_k_ids


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3_moe"
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    sliding_window: int | None = 4096
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = False
    mlp_only_layers: list[int] = field(default_factory=list)

    qk_norm = True

    @classmethod
    def normalise(cls, config):
        config = super().normalise(config)
        # Newer transformers writes the expert count as num_local_experts.
        if "num_experts" not in config and "num_local_experts" in config:
            config["num_experts"] = config["num_local_experts"]
        return config

    def is_sparse(self, index: int) -> bool:
        return (
            index not in (self.mlp_only_layers or [])
            and self.num_experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, activation(args.hidden_act)
        )

    def __call__(self, x: mx.array) -> mx.array:
        return self.experts(x, self.gate(x))

    def choose_experts(self, x: mx.array) -> mx.array:
        """The experts this block's router picks for ``x`` (the softmax keeps the order)."""
        return top_k_ids(self.gate(x), self.top_k)

    def experts(self, x: mx.array, router_logits: mx.array) -> mx.array:
        """The chosen experts' outputs for ``x``, weighted, given the router's logits."""
        probs = mx.softmax(router_logits.astype(mx.float32), axis=-1)
        k = self.top_k
        chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, args: ModelArgs, window: int | None, index: int):
        self.index = index
        super().__init__(args, window)

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        if args.is_sparse(self.index):
            return SparseMoeBlock(args)
        return super().make_mlp(args)


class MoeModel(llama.LlamaModel):
    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return DecoderLayer(args, window, index)


class Model(llama.Model):
    model_class = MoeModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return stack_experts(super().sanitize(weights), self.args)


def stack_experts(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Every MoE layer's experts as the ``switch_mlp`` stacks MLX runs."""
    for i in range(args.num_hidden_layers):
        stack_expert_weights(weights, f"model.layers.{i}.mlp", args.num_experts)
    return weights
