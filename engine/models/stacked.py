"""Projections that read the same input (q/k/v, gate/up) computed as one matmul.

A decode step is bound by how many kernels it launches, and q, k and v (gate and up)
are separate matmuls over the same activations. Stacking their rows makes them one
(for inputs of up to ``MAX_STACKED_ROWS`` rows; longer ones run the layers one by one).

The layers themselves stay (adapters wrap them by path, checkpoints name them); their
arrays become row views of the stacked arrays, so no weight is held twice: slices of
an evaluated array share its buffer.

A layer computes each output row from its own weight row alone, so the stacked matmul
gives the same values as the separate ones. The stack is used only while every layer
of its group is the one it was built from, still holds the arrays it was given, and
has no active adapter; otherwise each layer runs on its own (on the same views).

Expert layers stack too: a mixture-of-experts block's gate and up experts ([experts, out,
in] each, ``engine/models/switch.py``) become one [experts, 2 * out, in] array, so a
token's chosen experts take one gathered product instead of two. Those kinds say so with
``stacks_along`` (the output axis of their arrays: 1) and compute a product of any arrays
of their layout with ``product(arrays, x, *args)``. They stack for any number of rows:
a prefill's sorted expert products then run one tiled product of twice the width. Their
views are strided (each expert's gate rows, then its up rows), which MLX's CUDA expert
products refuse, so an adapter active on them does not set the stack aside: it adds its
change to its layer's part of the stacked output (``with_deltas``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.models.lora import LoRAHost
from engine.models.quantized_routing import affine_packed, quantized_fused, quantized_matmul

_KINDS = (nn.Linear, nn.QuantizedLinear)
# Stacking pays off per launch, so only for a few rows (decode steps, draft checks). For a
# long prefill chunk the split outputs are strided, and the copies the GPU makes of them
# stay alive until the chunk finishes: measured +0.6 GB peak on a 4B model, no speed-up.
MAX_STACKED_ROWS = 32
_ARRAYS = ("weight", "scales", "biases", "bias")


@dataclass
class _Stack:
    layers: tuple[nn.Module, ...]  # the layers it was built from (bases, never adapter hosts)
    views: tuple[dict[str, mx.array], ...]  # the arrays each layer was given
    stacked: dict[str, mx.array]
    splits: list[int]  # output offsets where the second, third ... layer's rows start
    sizes: tuple[int, ...] = ()  # how many entries each layer held once given its views
    max_rows: int | None = MAX_STACKED_ROWS  # longer inputs run the layers one by one

    def takes(self, x: mx.array) -> bool:
        return self.max_rows is None or x.size <= self.max_rows * x.shape[-1]

    def __call__(self, x: mx.array, *args) -> mx.array:
        """The layers' outputs side by side on the last axis (``args``: what an expert layer
        takes after ``x``, its expert ids)."""
        a, first = self.stacked, self.layers[0]
        if _axis(first):
            return first.product(a, x, *args)
        if isinstance(first, nn.QuantizedLinear):
            y = quantized_matmul(
                x,
                a["weight"],
                a["scales"],
                a.get("biases"),
                group_size=first.group_size,
                bits=first.bits,
                mode=getattr(first, "mode", "affine"),
            )
            return y + a["bias"] if "bias" in a else y
        if "bias" in a:
            return mx.addmm(a["bias"], x, a["weight"].T)
        return x @ a["weight"].T

    def fused(self, x: mx.array, norm: nn.Module | None = None, glu: bool = False) -> mx.array | None:
        """The stacked product of ``norm(x)`` (x without a norm; with ``glu``, ``silu(first) *
        second`` of it), quantized linear layers without biases, in one launch with the norm in
        the CUDA kernel's prologue and the activation in its epilogue; None where the kernel
        does not take it (the caller then runs the steps it did not)."""
        a, first = self.stacked, self.layers[0]
        if type(first) is not nn.QuantizedLinear or "bias" in a or (glu and len(self.layers) != 2):
            return None
        packed = (a["weight"], a["scales"], a.get("biases"))
        quantization = {"group_size": first.group_size, "bits": first.bits, "mode": getattr(first, "mode", "affine")}
        return quantized_fused(x, *packed, norm=norm, glu=glu, **quantization)


class _Stacks:
    """Plain holder, so MLX's module tree does not count the stacked arrays as parameters."""

    def __init__(self) -> None:
        self.by_names: dict[tuple[str, ...], _Stack] = {}


def _arrays(layer: nn.Module) -> dict[str, mx.array]:
    return {k: layer[k] for k in _ARRAYS if k in layer}


def _axis(layer: nn.Module) -> int:
    """The output axis of the layer's arrays: 0 for a linear layer, ``stacks_along`` for an
    expert layer."""
    return getattr(type(layer), "stacks_along", 0)


def _stackable(layer: nn.Module) -> bool:
    """A linear layer, or an expert layer holding nothing but the arrays a stack splits (an
    nvfp4 layer's per-expert scale is its own: it never stacks)."""
    if type(layer) in _KINDS:
        return True
    return bool(_axis(layer)) and all(k in _ARRAYS for k in layer)


def _current(module: nn.Module, names: tuple[str, ...], adapted: bool = False) -> _Stack | None:
    """The module's stack for ``names`` if it still computes what the layers compute (with
    ``adapted``, what the bases of expert layers compute: their adapters add their changes
    to the stacked output, ``with_deltas``)."""
    stacks = module.__dict__.get("_stacks")
    stack = stacks.by_names.get(names) if stacks is not None else None
    if stack is None:
        return None
    for name, base, views, size in zip(names, stack.layers, stack.views, stack.sizes):
        layer = module.get(name)
        if layer is not base:
            if not isinstance(layer, LoRAHost) or layer.base is not base:
                return None
            if layer._deltas.active and not (adapted and _axis(base)):
                return None
        # Runs before every stacked matmul, so kept to lookups: the layer holds exactly
        # what it held when stacked (each view, and as many entries: none added).
        if len(base) != size or any(base.get(k) is not v for k, v in views.items()):
            return None
    return stack


def _usable(module: nn.Module, names: tuple[str, ...], x: mx.array, adapted: bool = False) -> _Stack | None:
    stack = _current(module, names, adapted)
    return stack if stack is not None and stack.takes(x) else None


def _adapted(layer: nn.Module, y: mx.array, x: mx.array, *args) -> mx.array:
    """``y`` plus the changes of the adapters active on ``layer``."""
    if isinstance(layer, LoRAHost) and layer._deltas.active:
        return layer.with_deltas(y, x, *args)  # type: ignore[attr-defined]
    return y


def stacked_output(module: nn.Module, names: tuple[str, ...], x: mx.array) -> mx.array | None:
    """The named layers' outputs concatenated on the last axis, in one matmul; None when
    the layers are not (or no longer) stacked, an adapter acts on one of them, or ``x``
    has more rows than the stack takes (``MAX_STACKED_ROWS`` for linear layers)."""
    stack = _usable(module, names, x)
    return stack(x) if stack is not None else None


def stacked_normed(
    module: nn.Module, names: tuple[str, ...], x: mx.array, norm: nn.Module | None = None, glu: bool = False
) -> tuple[mx.array | None, mx.array]:
    """The stacked output of ``n = norm(x)`` (``n = x`` without a norm) with as few launches
    as the CUDA kernel allows, and the input a caller's own fallback takes.

    First the norm in the kernel's prologue; where it does not take that, the norm on its own
    and the stacked product of its output. With ``glu`` the two layers are (gate, up) and the
    output is ``silu(gate(n)) * up(n)``, the activation in the kernel's epilogue (so None
    where the kernel does not take the product). Returns (output or None, n): on None the
    caller runs the layers one by one on n, which is already normed."""
    stack = _usable(module, names, x)
    if stack is not None and norm is not None:
        y = stack.fused(x, norm, glu)
        if y is not None:
            return y, x
    if norm is not None:
        x = norm(x)
    if stack is None:
        return None, x
    return (stack.fused(x, glu=True) if glu else stack(x)), x


def packed_stack(module: nn.Module, names: tuple[str, ...], x: mx.array) -> tuple[mx.array, ...] | None:
    """The stack's (weight, scales, biases) where the named layers are stacked affine quantized
    linear layers without biases of their own and the stack takes ``x``: what a kernel that
    runs the stacked product inside a larger launch reads (models.layer_tail_cuda)."""
    stack = _usable(module, names, x)
    if stack is None:
        return None
    a = stack.stacked
    if affine_packed(stack.layers[0]) is None or "bias" in a or a.get("biases") is None:
        return None
    return a["weight"], a["scales"], a["biases"]


def project(module: nn.Module, names: tuple[str, ...], x: mx.array, *args) -> list[mx.array]:
    """Each named layer's output: split from one stacked matmul where possible (``args``:
    what expert layers take after ``x``). Expert layers with an adapter active keep their
    stack and add the adapter's change to their part of it: alone, they would run on their
    strided views of the stack, which MLX's CUDA expert products refuse."""
    stack = _usable(module, names, x, adapted=True)
    if stack is None:
        return [getattr(module, n)(x, *args) for n in names]
    parts = mx.split(stack(x, *args), stack.splits, axis=-1)
    return [_adapted(module.get(n), y, x, *args) for n, y in zip(names, parts)]


def _build(module: nn.Module, names: tuple[str, ...]) -> _Stack | None:
    layers = []
    for name in names:
        layer = module.get(name)
        layer = layer.base if isinstance(layer, LoRAHost) else layer
        if not _stackable(layer):
            return None
        layers.append(layer)
    first = layers[0]
    keys = _arrays(first).keys()
    axis = _axis(first)

    def same(layer: nn.Module) -> bool:
        arrays = _arrays(layer)
        if type(layer) is not type(first) or arrays.keys() != keys:
            return False
        if any(
            arrays[k].dtype != first[k].dtype
            or arrays[k].shape[:axis] + arrays[k].shape[axis + 1 :]
            != first[k].shape[:axis] + first[k].shape[axis + 1 :]
            for k in keys
        ):
            return False
        quant = ("group_size", "bits", "mode")
        return all(getattr(layer, q, None) == getattr(first, q, None) for q in quant)

    if not all(same(layer) for layer in layers):
        return None
    stacked = {k: mx.concatenate([layer[k] for layer in layers], axis=axis) for k in keys}
    mx.eval(stacked)
    rows = [layer["weight"].shape[axis] for layer in layers]
    starts = [sum(rows[:i]) for i in range(len(rows) + 1)]
    lead = (slice(None),) * axis
    views = tuple(
        {k: a[(*lead, slice(starts[i], starts[i + 1]))] for k, a in stacked.items()} for i in range(len(layers))
    )
    mx.eval(views)
    for layer, arrays in zip(layers, views):
        for k, a in arrays.items():
            layer[k] = a  # the layer's old buffer goes once nothing else holds it
    sizes = tuple(len(layer) for layer in layers)
    return _Stack(tuple(layers), views, stacked, starts[1:-1], sizes, None if axis else MAX_STACKED_ROWS)


def stack_projections(model: nn.Module) -> int:
    """Stack the projections of every module that names groups in ``stacked_projections``,
    where not already stacked. Returns how many groups were (re)built. Call it when no
    traced function holds the old arrays, or they stay alive beside the stacked ones."""
    built = 0
    for module in model.modules():
        # Asked of the module, not its class: an expert block whose experts stream from disk
        # names none (its store fills each projection's slots itself).
        groups: Sequence[tuple[str, ...]] = getattr(module, "stacked_projections", ())
        for names in groups:
            if _current(module, names) is not None:
                continue
            stacks = module.__dict__.get("_stacks")
            if stacks is None:
                stacks = _Stacks()
                object.__setattr__(module, "_stacks", stacks)
            stacks.by_names.pop(names, None)  # a stale stack would keep its old buffer alive
            stack = _build(module, names)
            if stack is None:
                continue
            stacks.by_names[names] = stack
            built += 1
    return built
