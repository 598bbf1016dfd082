"""Sigmoid-routed mixture of experts with shared experts: DeepSeek V3, Kimi K2, GLM-4.5/4.6/4.7
(MoE and Flash), GLM-5.

Routing as DeepSeek V3 defines it ("noaux_tc"): sigmoid scores; a per-expert correction
bias (``e_score_correction_bias``) shifts which experts are chosen but not their
weights; with ``n_group`` > 1 only the ``topk_group`` groups whose two best biased scores
sum highest compete; the chosen scores are renormalised (``norm_topk_prob``) and scaled
by ``routed_scaling_factor``. Shared experts (one gated MLP ``n_shared_experts`` times
as wide) see every token. Routed experts live stacked in ``switch_mlp`` (mlx-lm's layout).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.base import GatedMLP, activation
from engine.models.switch import SwitchGLU
from engine.models.switch import stack_expert_weights as stack_experts  # noqa: F401  (the families import it from here)


def held_in_float32(name: str) -> bool:
    """Whether a stored weight is the router's (``*.mlp.gate.weight``), which is held in
    float32 whatever its stored dtype (``GroupLimitedRouter``): the memory plan counts it so."""
    return name.endswith(".mlp.gate.weight")


class GroupLimitedRouter(nn.Module):
    """HF's ``mlp.gate``: ``weight`` [experts, hidden] and ``e_score_correction_bias``.
    Plain arrays, not a Linear: routing runs in float32 and is never quantized."""

    def __init__(self, args: Any):
        super().__init__()
        n = args.n_routed_experts
        self.weight = mx.zeros((n, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((n,))
        self.top_k = args.num_experts_per_tok
        self.n_group = args.n_group or 1
        self.topk_group = args.topk_group or 1
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor

    def __setitem__(self, key, value) -> None:
        # The router weight is held in float32 however it is loaded or cast (a bf16
        # checkpoint, ``set_dtype``): routing multiplies in float32 anyway, and a cast
        # held once is one kernel less per layer and decode step than a cast per call.
        if key == "weight" and isinstance(value, mx.array) and value.dtype != mx.float32:
            value = value.astype(mx.float32)
        super().__setitem__(key, value)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(chosen experts [..., k], their weights [..., k] in float32)."""
        return _route(
            x,
            self.weight,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scaling,
        )


@mx.compile
def _route(x, weight, bias, k: int, n_group: int, topk_group: int, norm: bool, scaling: float):
    # One fused function (a dozen small ops), traced once per shape and setting.
    logits = x.astype(mx.float32) @ weight.astype(mx.float32).T
    scores = mx.sigmoid(logits)
    choice = scores + bias.astype(mx.float32)
    if 1 < n_group and topk_group < n_group:
        grouped = mx.unflatten(choice, -1, (n_group, -1))
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [..., groups]
        dropped = mx.argpartition(group_scores, kth=n_group - topk_group - 1, axis=-1)[..., : n_group - topk_group]
        grouped = mx.put_along_axis(grouped, dropped[..., None], mx.array(-mx.inf, mx.float32), axis=-2)
        choice = mx.flatten(grouped, -2, -1)
    chosen = mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    if norm:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return chosen, weights * scaling


class RoutedMoE(nn.Module):
    """``gate`` (the router), ``switch_mlp`` (stacked routed experts) and, when the
    config has them, ``shared_experts``."""

    def __init__(self, args: Any):
        super().__init__()
        act = activation(getattr(args, "hidden_act", "silu"))
        self.gate = GroupLimitedRouter(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, act)
        if args.n_shared_experts:
            width = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = GatedMLP(args.hidden_size, width, activation=act)

    def __call__(self, x: mx.array) -> mx.array:
        chosen, weights = self.gate(x)
        y = self.switch_mlp(x, chosen)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y

    def choose_experts(self, x: mx.array) -> mx.array:
        return self.gate(x)[0]


def drop_nextn_layers(weights: dict[str, mx.array], n_layers: int) -> dict[str, mx.array]:
    """Leave out the multi-token-prediction (MTP) layers that DeepSeek V3 and GLM
    checkpoints append after the decoder (``model.layers.{n_layers}`` and on), which plain
    decoding does not run. Their names stay as published."""
    return {k: v for k, v in weights.items() if (nextn_index(k) or 0) < n_layers}


def nextn_index(key: str) -> int | None:
    """The decoder layer index in a weight's name (``model.layers.{i}.``), None for others."""
    if not key.startswith("model.layers."):
        return None
    head = key[len("model.layers.") :].split(".", 1)[0]
    return int(head) if head.isdigit() else None
