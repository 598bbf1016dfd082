"""Expert layers for mixture-of-experts blocks: every expert's weights in one stacked array.

``SwitchLinear`` holds [experts, out, in] and multiplies each token by the experts it
was routed to with ``mx.gather_mm``; ``to_quantized`` makes it a
``QuantizedSwitchLinear`` (``mx.gather_qmm``), so ``nn.quantize`` handles MoE models.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from engine.errors import ModelLoadError
from engine.models import quantized_matmul_cuda as qmv

# Sorting tokens by expert pays off once there are enough of them (prefill), since each
# expert's weights are then read once for a run of tokens.
SORT_THRESHOLD = 64
# Passes of at most this many tokens (a decode step, a speculative verify pass: 32 rows, as
# for stacked projections) never sort: a GPU runs other expert kernels for sorted tokens, whose
# sums round otherwise, and a verify pass must give each token what a one-token step gives
# (8 tokens x 8 experts would sort, where a step never does).
UNSORTED_TOKENS = 32
# nvfp4's per-tensor scale maps amax onto the largest value an e4m3 group scale (448) times
# an e2m1 weight (6) can hold.
NVFP4_RANGE = 448.0 * 6.0


class SwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        limit = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-limit, limit, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self.weight
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU gather_mm handles float32 only; other devices take any float type.
            y = mx.gather_mm(
                x.astype(mx.float32),
                w.astype(mx.float32).swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            ).astype(x.dtype)
        else:
            y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        global_scale: bool = False,
        **_,
    ):
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode, global_scale)


def _quantize_experts(w: mx.array, group_size, bits, mode: str) -> list[mx.array]:
    """nvfp4 with one float32 scale per expert (mlx-lm's ``global_scale`` layout): each
    expert's e4m3 group scales are then relative to its largest weight."""
    if mode != "nvfp4":
        raise ValueError(f"a per-expert global scale needs nvfp4, not {mode}")
    gs = mx.max(mx.abs(w), axis=(-2, -1)).astype(mx.float32)
    parts = [mx.quantize(w[e], group_size, bits, mode=mode, global_scale=gs[e]) for e in range(w.shape[0])]
    return [mx.stack([p[0] for p in parts]), mx.stack([p[1] for p in parts]), gs]


class QuantizedSwitchLinear(nn.Module):
    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        bias: bool = False,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        global_scale: bool = False,
    ):
        super().__init__()
        self.mode = mode
        parts = mx.quantize(mx.zeros((num_experts, output_dims, input_dims)), group_size, bits, mode=mode)
        self.weight, self.scales = parts[0], parts[1]
        if len(parts) > 2:
            self.biases = parts[2]
        if global_scale:
            self.global_scale = mx.ones((num_experts,), dtype=mx.float32)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        # The packed layout tells the group size and bits actually used (None picks defaults).
        self.bits = self.weight.shape[-1] * 32 // input_dims
        self.group_size = input_dims // self.scales.shape[-1]
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        global_scale = self.get("global_scale")
        if global_scale is None:
            # A decode step's few rows may take our CUDA kernel (only when asked: measured no
            # faster than MLX's on MoE shapes, docs/qmv.md).
            y = qmv.gather_quantized_matmul(
                x,
                self["weight"],
                self["scales"],
                self.get("biases"),
                indices,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
                sorted_indices=sorted_indices,
            )
        else:
            y = self._globally_scaled(x, indices, global_scale, sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def _globally_scaled(self, x: mx.array, indices: mx.array, global_scale: mx.array, sorted_indices: bool):
        """The product of experts with a per-expert scale as well (nvfp4)."""
        on_cpu = mx.default_device() == mx.cpu
        y = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            global_scale=None if on_cpu else global_scale,
            sorted_indices=sorted_indices,
        )
        if on_cpu:
            # MLX's CPU kernels take no global scale. It multiplies each expert's weights by
            # its scale / (448 * 6) (the largest e4m3 group scale times the largest e2m1
            # value), so it can multiply each expert's output instead.
            y = y * mx.expand_dims(global_scale[indices] / NVFP4_RANGE, (-2, -1)).astype(y.dtype)
        return y

    @classmethod
    def from_switch_linear(cls, layer: SwitchLinear, group_size, bits, mode, global_scale: bool = False):
        n, out_dims, in_dims = layer.weight.shape
        q = cls(in_dims, out_dims, n, "bias" in layer, group_size, bits, mode, global_scale)
        if global_scale:
            q.weight, q.scales, q.global_scale = _quantize_experts(layer.weight, q.group_size, q.bits, mode)
        else:
            parts = mx.quantize(layer.weight, q.group_size, q.bits, mode=mode)
            q.weight, q.scales = parts[0], parts[1]
            if len(parts) > 2:
                q.biases = parts[2]
        if "bias" in layer:
            q.bias = layer.bias
        return q


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

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., dims], indices [..., k] -> [..., k, dims] (one output per chosen expert)."""
        if self.streamed is not None:
            return self.streamed.run(x, indices)
        return self.routed(x, indices)

    def routed(self, x: mx.array, indices: mx.array) -> mx.array:
        """The experts' outputs, ``indices`` naming rows of the stacked arrays."""
        k = indices.shape[-1]
        lead = indices.shape[:-1]
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, dims]
        do_sort = indices.size >= SORT_THRESHOLD and indices.size // k > UNSORTED_TOKENS
        idx = indices
        if do_sort:
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            x = x.reshape(-1, 1, x.shape[-1])[order // k]  # [n*k, 1, dims]
            idx = flat[order]
        h = self.combine(self.gate_proj(x, idx, do_sort), self.up_proj(x, idx, do_sort))
        y = self.down_proj(h, idx, do_sort)
        if do_sort:
            y = y[inverse].reshape(*lead, k, 1, -1)
        return y.squeeze(-2)

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
