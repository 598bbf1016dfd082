"""The memory a training run needs, estimated before it starts, and the refusal when the
budget cannot hold it.

Four parts: the weights as loaded; the adapter (float32) with its gradient; the
optimizer's state (Adam and AdamW keep two float32 arrays per adapter value, plain SGD
none); and the activations kept for the backward pass for ``batch_size`` rows of the
longest length trained. Per block and token those are about 34 * hidden values plus
5 * heads * length attention values (Korthikanti et al., "Reducing Activation
Recomputation"); with gradient checkpointing only each block's input is kept, plus one
block's activations while it is recomputed. The logits add batch * length * vocab
values three times over (logits, their log-softmax, its gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.training.adapters import TrainingError


@dataclass
class TrainingPlan:
    weights_bytes: int
    adapter_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.adapter_bytes + self.optimizer_bytes + self.activation_bytes


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def plan_training(
    model: nn.Module, *, batch_size: int, length: int, optimizer: str, grad_checkpoint: bool, dtype_bytes: int = 4
) -> TrainingPlan:
    args: Any = getattr(model, "args", None)
    hidden = int(getattr(args, "hidden_size", 0) or 0)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    vocab = int(getattr(args, "vocab_size", 0) or 0)
    blocks = len(getattr(model, "layers", []) or [])
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))
    adapter_values = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    adapter = adapter_values * 4 * 2  # values and their gradient
    state = adapter_values * 4 * (2 if optimizer in ("adam", "adamw") else 0)
    tokens = batch_size * length
    per_block = tokens * (34 * hidden + 5 * heads * length) * dtype_bytes // 2
    if grad_checkpoint:
        kept = tokens * hidden * dtype_bytes * blocks + per_block
    else:
        kept = per_block * blocks
    logits = 3 * tokens * vocab * 4
    return TrainingPlan(weights, adapter, state, kept + logits)


def check_plan(plan: TrainingPlan, budget: int, *, batch_size: int, length: int, grad_checkpoint: bool) -> None:
    """TrainingError with the numbers and what to change when ``plan`` exceeds ``budget``."""
    if budget <= 0 or plan.total_bytes <= budget:
        return
    advice = []
    if not grad_checkpoint:
        advice.append("add --grad-checkpoint")
    if batch_size > 1:
        advice.append(f"use --batch-size {max(1, batch_size // 2)}")
    advice.append(f"lower --max-seq-len (the longest row is {length} tokens)")
    raise TrainingError(
        f"Training needs about {_gb(plan.total_bytes)} (weights {_gb(plan.weights_bytes)}, adapter "
        f"{_gb(plan.adapter_bytes)}, optimizer state {_gb(plan.optimizer_bytes)}, activations "
        f"{_gb(plan.activation_bytes)} for {batch_size} rows of {length} tokens) but the memory budget is "
        f"{_gb(budget)}: {', or '.join(advice)}."
    )
