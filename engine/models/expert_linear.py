"""Expert layers: every expert's weights of one projection in one stacked array.

``SwitchLinear`` holds [experts, out, in] and multiplies each token by the experts it
was routed to with ``mx.gather_mm``; ``to_quantized`` makes it a
``QuantizedSwitchLinear`` (``mx.gather_qmm``), so ``nn.quantize`` handles MoE models.
Both compute their product from any arrays of their layout (``product``), so a stack of
several such layers (``engine/models/stacked.py``) runs as one. The blocks built of them
are in ``engine/models/switch.py``.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from engine.models import gathered_matmul_cuda as gathered

# nvfp4's per-tensor scale maps amax onto the largest value an e4m3 group scale (448) times
# an e2m1 weight (6) can hold.
NVFP4_RANGE = 448.0 * 6.0


class SwitchLinear(nn.Module):
    stacks_along = 1  # its arrays' output axis: [experts, out, in], bias [experts, out]

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
        return self.product(self, x, indices, sorted_indices)

    def product(self, a, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """The product with ``a``'s arrays (this layer's own, or a stack of layers like it)."""
        w = a["weight"]
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
        if "bias" in a:
            y = y + mx.expand_dims(a["bias"][indices], -2)
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
    stacks_along = 1

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
            return self.product(self, x, indices, sorted_indices)
        y = self._globally_scaled(x, indices, global_scale, sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def product(self, a, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """The product with ``a``'s arrays (this layer's own, or a stack of layers like it),
        without a per-expert scale."""
        # A decode step's few rows may take our CUDA kernel (only when asked: measured no
        # faster than MLX's on MoE shapes, docs/qmv.md).
        y = gathered.gather_quantized_matmul(
            x,
            a["weight"],
            a["scales"],
            a.get("biases"),
            indices,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in a:
            y = y + mx.expand_dims(a["bias"][indices], -2)
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
