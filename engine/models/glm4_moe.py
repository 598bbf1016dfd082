"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``): grouped-query attention with partial RoPE (half the
head by default), optional per-head query/key norms, biased q/k/v but not o; the first
``first_k_dense_replace`` layers dense, the rest sigmoid-routed experts with a correction
bias and a shared expert (``routed_moe.py``). MTP layers after the decoder are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import llama, routed_moe
from engine.models.routed_moe import RoutedMoE, drop_nextn_layers, nextn_index, stack_experts


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "glm4_moe"
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_shared_experts: int | None = 1
    n_routed_experts: int | None = 128
    routed_scaling_factor: float = 1.0
    n_group: int | None = 1
    topk_group: int | None = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        has_factor = "partial_rotary_factor" in config or "partial_rotary_factor" in (
            config.get("rope_parameters") or {}
        )
        config = super().normalise(config)
        if not has_factor:  # transformers' GLM default: rotate half of each head
            config["partial_rotary_factor"] = 0.5
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config["n_routed_experts"] = config["num_local_experts"]
        return config

    qk_norm = property(lambda self: self.use_qk_norm)
    o_bias = False

    def is_sparse(self, index: int) -> bool:
        return bool(self.n_routed_experts) and index >= self.first_k_dense_replace


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, args: ModelArgs, window: int | None, index: int):
        self.index = index
        super().__init__(args, window)

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return RoutedMoE(args) if args.is_sparse(self.index) else super().make_mlp(args)


class Glm4MoeModel(llama.LlamaModel):
    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return DecoderLayer(args, window, index)


class Model(llama.Model):
    model_class = Glm4MoeModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = drop_nextn_layers(super().sanitize(weights), self.args.num_hidden_layers)
        for i in range(self.args.num_hidden_layers):
            stack_experts(weights, f"model.layers.{i}.mlp", self.args.n_routed_experts or 0)
        return weights


# The memory plan asks the family which stored weights it holds in float32 (its routers).
held_in_float32 = routed_moe.held_in_float32


def resident_weight(name: str, n_layers: int) -> str | None:
    """The appended MTP layers are left out at load (None); the memory plan does not count them."""
    index = nextn_index(name)
    return None if index is not None and index >= n_layers else "model"
