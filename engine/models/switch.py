"""Mixture-of-experts blocks over expert layers (``engine/models/expert_linear.py``: every
expert's weights of a projection in one stacked array, re-exported here).

A ``SwitchGLU``'s gate and up experts are stacked into one array once decoding starts
(``engine/models/stacked.py``): every token's chosen experts then take one gathered
product for both, half the launches of a decode step's expert products (mlx-vlm's
DiffusionGemma holds them fused the same way; mlx-lm keeps them apart).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from engine.errors import ModelLoadError
from engine.models.expert_blocks import ExpertBlocks, blocks_pay
from engine.models.expert_linear import NVFP4_RANGE, QuantizedSwitchLinear, SwitchLinear
from engine.models.stacked import project

__all__ = ["NVFP4_RANGE", "QuantizedSwitchLinear", "SwitchLinear"]

# Sorting tokens by expert pays off once there are enough of them (prefill), since each
# expert's weights are then read once for a run of tokens.
SORT_THRESHOLD = 64
# Passes of at most this many tokens (a decode step, a speculative verify pass: 32 rows, as
# for stacked projections) never sort: a GPU runs other expert kernels for sorted tokens, whose
# sums round otherwise, and a verify pass must give each token what a one-token step gives
# (8 tokens x 8 experts would sort, where a step never does).
UNSORTED_TOKENS = 32
GATE_UP = ("gate_proj", "up_proj")


def top_k_ids(scores: mx.array, k: int) -> mx.array:
    """The ids of the ``k`` highest ``scores`` along the last axis, in no particular order."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


class SwitchGLU(nn.Module):
    """Per-token gated MLPs of the chosen experts: down(act(gate(x)) * up(x))."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int, activation=nn.silu, bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden_dims, num_experts, bias)
        self.up_proj = SwitchLinear(dims, hidden_dims, num_experts, bias)
        self.down_proj = SwitchLinear(hidden_dims, dims, num_experts, bias)
        self.activation = activation

    # Set when the experts stream from disk (engine.models.expert_store.ExpertLayer): the
    # stacked arrays then hold a slab of slots, and expert ids become slot ids first. The
    # block that routes to these experts has ``choose_experts(x) -> ids [..., k]``: its
    # router's choice alone, which streaming uses to guess a layer's experts a layer early.
    streamed = None

    @property
    def stacked_projections(self) -> tuple[tuple[str, ...], ...]:
        """Gate and up as one array (``stack_projections``), unless streamed: the store then
        fills each projection's slots itself."""
        return () if self.streamed is not None else (GATE_UP,)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., dims], indices [..., k] -> [..., k, dims] (one output per chosen expert)."""
        if self.streamed is not None:
            return self.streamed.run(x, indices)
        return self.routed(x, indices)

    def routed(self, x: mx.array, indices: mx.array) -> mx.array:
        """The experts' outputs, ``indices`` naming rows of the stacked arrays."""
        k = indices.shape[-1]
        lead = indices.shape[:-1]
        if indices.size >= SORT_THRESHOLD and indices.size // k > UNSORTED_TOKENS:
            pairs = self.blocked if blocks_pay(indices.size, self.stacked_rows) else self.sorted_pairs
            return pairs(x, indices).reshape(*lead, k, -1)
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, dims]
        gate, up = project(self, GATE_UP, x, indices, False)
        return self.down_proj(self.combine(gate, up), indices, False).squeeze(-2)

    @property
    def stacked_rows(self) -> int:
        """The rows of the stacked arrays that ``indices`` name: the experts, or a streamed
        layer's slots."""
        return self.down_proj["weight"].shape[0]

    def sorted_pairs(self, x: mx.array, indices: mx.array) -> mx.array:
        """The experts' outputs [pairs, dims] for a long pass, its pairs sorted by expert so
        that MLX's kernel can serve a run of them from one read of the expert (Metal does)."""
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        idx = flat[order]
        xs = x.reshape(-1, 1, x.shape[-1])[order // k]  # [pairs, 1, dims]
        gate, up = project(self, GATE_UP, xs, idx, True)
        y = self.down_proj(self.combine(gate, up), idx, True)
        return y.reshape(-1, y.shape[-1])[mx.argsort(order)]

    def blocked(self, x: mx.array, indices: mx.array, rows: int | None = None) -> mx.array:
        """The experts' outputs [pairs, dims] for a long pass, its pairs in blocks of one
        expert each (``engine/models/expert_blocks.py``: how MLX's CUDA product reads each
        expert once a block)."""
        layout = ExpertBlocks.of(indices, self.stacked_rows, rows)
        xb = layout.gather(x.reshape(-1, x.shape[-1]), indices.shape[-1])
        gate, up = project(self, GATE_UP, xb, layout.experts, True)
        y = self.down_proj(self.combine(gate, up), layout.experts, True)
        return layout.scatter(y)

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        """The gated hidden activations; families with another gating override this."""
        return self.activation(gate) * up


class MissingExperts(ModelLoadError):
    """Some experts of a MoE layer are in no weight file (the loader says where to look)."""

    def __str__(self) -> str:
        return f"the checkpoint {self.args[0]}; the download is incomplete or its index is wrong"


def stack_expert_weights(weights: dict[str, mx.array], prefix: str, num_experts: int) -> dict[str, mx.array]:
    """Put one MoE block's experts (under ``prefix``, e.g. ``model.layers.3.mlp``) into the
    ``switch_mlp`` layout, from either Hugging Face spelling: transformers 5's fused
    ``experts.gate_up_proj`` [E, 2I, H] + ``experts.down_proj`` [E, H, I], or one module per
    expert (``experts.N.gate_proj.weight`` ..., quantized parts included). Changes ``weights``."""
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        half = fused.shape[1] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = fused[:, :half]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = fused[:, half:]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
        return weights
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for part in ("weight", "scales", "biases", "bias"):
            names = [f"{prefix}.experts.{e}.{proj}.{part}" for e in range(num_experts)]
            if names[0] not in weights:
                continue
            missing = [e for e, name in enumerate(names) if name not in weights]
            if missing:
                raise MissingExperts(
                    f"lacks {len(missing)} of the {num_experts} experts' {proj}.{part} in {prefix} "
                    f"(first: {names[missing[0]]})"
                )
            weights[f"{prefix}.switch_mlp.{proj}.{part}"] = mx.stack([weights.pop(name) for name in names])
    return weights
