"""Which quantized products take the small-row CUDA kernel (models.quantized_matmul_cuda),
and the entry points the models call: a layer's product (``linear``), with the residual add
(``linear_plus``), a tied head (``embedding_logits``), and a stacked product with its norm and
activation (``quantized_fused``).

A product takes the kernel where MLX's CUDA backend runs on the GPU, the kernel computes it
(``kernel.takes``) and is faster there than MLX's own (``pays``, by the measurements below),
unless ``MLX_DESK_QMV`` is ``0``. Each small op the kernel can take into a product has its
own switch (``FUSIONS``). Everything else (other modes and bit widths, more rows, the CPU)
keeps ``mx.quantized_matmul``. Products of ``MMA_ROWS`` rows go to the tensor-core kernel
instead (models.quantized_mma_cuda) unless ``MLX_DESK_QMV_MMA`` is ``0``. On CUDA a batch's
rows ([B, L, K]) reach MLX's kernel as one matrix, with ours on or off: MLX runs the leading
axis as that many separate products, each reading the whole weight.

The kernel module's functions are called through it (``kernel.matmul``), so a test that
counts the kernel's launches sees these calls too.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.models import quantized_matmul_cuda as kernel
from engine.models import quantized_mma_cuda as tensor_cores
from engine.models.kernel_switches import switch

# Where the kernel is routed (measured on an H200, 4-bit g64, docs/qmv.md): from 2 to 7 rows
# it beats or ties MLX's kernel on every projection (MLX runs up to 7 rows as that many
# one-row products: qwen3-4b's gate+up at 7 rows 205 us against ours 65). From 8 rows MLX's
# tiled kernel wins a microbenchmark of 32 independent products in flight (30 against 64 us),
# but not a step, where each product waits for the one before: qwen3-4b's batch step of 8
# rows took 7.4 ms through ours against 12.0 through MLX's, 12 streams decoded at 814 against
# 783 tok/s, and 16 at 874 against 964, so up to 12 rows route here. At one row it wins only
# on large matrices (llama3-8b's gate+up 49 us against 75, its down 37 against 41) and loses
# on small ones (qwen3-4b's q, 2560x4096: 15.3 us against 13.1), so one row routes from 16M
# weights.
ROUTED_ROWS = range(2, 13)
ONE_ROW_MIN_WEIGHTS = 16 << 20
# A one-row product that takes a small op into it (a residual add, an activation, a norm)
# saves a launch besides, so it routes here from this size: qwen3-4b's q/k/v (2560 x 6144, with
# its norm) and output product (4096 x 2560, with its add) then take the kernel at one row,
# and its compiled step went from 403 ops and 3.99 ms to 295 and 3.05 (docs/qmv.md).
ONE_ROW_FUSED_MIN_WEIGHTS = 8 << 20
# The small ops the kernel takes into a product (``fusion_enabled``; docs/qmv.md), each on
# wherever the kernel runs unless its variable is 0: the residual add in the epilogue, a gated
# MLP's activation in its stacked gate/up product's epilogue, the input's RMSNorm in the prologue.
RESIDUAL_ENV = "MLX_DESK_QMV_RESIDUAL"
GLU_ENV = "MLX_DESK_QMV_GLU"
NORM_ENV = "MLX_DESK_QMV_NORM"
FUSIONS = {"residual": RESIDUAL_ENV, "glu": GLU_ENV, "norm": NORM_ENV}
# The widest rows whose RMSNorm joins a product's prologue: each block norms the rows itself
# before its first weight load, which pays where the rows are short and the launches count, and
# loses where they are long and the reads count. Measured (docs/qmv.md, "The activation and the
# norms inside the products"): llama3-8b (4,096 wide) decoded faster with the norm on its own on
# an H100 and an H200 (1.54x against 1.38x mlx-lm, 1.74x against 1.48x); qwen3-4b (2,560) a wash.
NORM_PROLOGUE_MAX_WIDTH = 3072
# The rows the tensor-core kernel takes (unless ``MLX_DESK_QMV_MMA=0``), ahead of the row kernel
# and MLX's, which keep the other rows; it takes the residual add and the activation, and the
# norm steps out of the product there. Measured in whole steps (qwen3-4b, 4-bit g64,
# docs/qmv.md; before those epilogues): 8 streams 1128.8 against 989.0 tok/s on an H100 and
# 1259.7 against 975.8 on an H200, 16 streams 1375.4 against 988.2 and 1591.2 against 969.8.
# A verify pass of 5 rows lost through it (n-gram drafting 226.8 against 265.6 tok/s, with
# 2-16 rows routed here), so 2-7 rows stay on the row kernel.
MMA_ROWS = range(8, 17)
# Other rows for an A/B (``MLX_DESK_QMV_MMA_ROWS=LO-HI``, 1 <= LO <= HI <= 16). At one row the
# row kernel's K loop runs about 5.3 instructions a code (NVIDIA's compiler, sm_90) and Nsight
# Compute showed its products issuing on 44-63% of cycles (docs/qmv.md, "Registers"); the
# tensor-core kernel's runs about 3.5 whatever the rows, at the price of 7 unused columns of
# each MMA.
MMA_ROWS_ENV = "MLX_DESK_QMV_MMA_ROWS"


def mma_rows() -> range:
    """The rows the tensor-core kernel takes: ``MMA_ROWS``, or ``MLX_DESK_QMV_MMA_ROWS``'s."""
    low, _, high = switch(MMA_ROWS_ENV, "").partition("-")
    if low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= 16:
        return range(int(low), int(high) + 1)
    return MMA_ROWS


def pays(rows: int, inputs: int, outputs: int, fused: bool = False) -> bool:
    """Whether a product the kernel can take (``kernel.fits``) is faster through it than through
    MLX's own kernel, by the measurements above (``fused``: with a residual add in its epilogue
    or a norm in its prologue, each a launch of its own beside MLX's kernel)."""
    if rows == 1:
        return inputs * outputs >= (ONE_ROW_FUSED_MIN_WEIGHTS if fused else ONE_ROW_MIN_WEIGHTS)
    return rows in ROUTED_ROWS


def _rows(x: mx.array, w: mx.array) -> int | None:
    """The rows of a product of ``x`` by a 2-D weight; None for other shapes (no kernel's)."""
    return x.size // max(x.shape[-1], 1) if w.ndim == 2 and x.ndim >= 1 else None


def _routed(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
    fused: bool = False,
) -> bool:
    """Whether the kernel takes the product of ``x`` by the [N, K] weight ``w``: turned on and
    able to run here, faster than MLX's at this size (``pays``), one it computes (``takes``)
    and not the tensor-core kernel's."""
    rows = _rows(x, w)
    if rows is None or not kernel.enabled() or _on_tensor_cores(x, w, scales, biases, group_size, bits, mode):
        return False
    return pays(rows, x.shape[-1], w.shape[0], fused) and kernel.takes(
        rows, x, w, scales, biases, group_size, bits, mode
    )


def _on_tensor_cores(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str
) -> bool:
    """Whether the tensor-core kernel takes the product: not turned off, ``mma_rows`` rows and one
    it computes (``tensor_cores.takes``)."""
    rows = _rows(x, w)
    return (
        rows in mma_rows()
        and tensor_cores.switched_on()
        and tensor_cores.takes(rows, x, w, scales, biases, group_size, bits, mode)
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul(..., transpose=True)``, through the kernel where it is enabled, fits
    and pays; where MLX's kernel keeps the product, a batch's rows reach it as one matrix
    (``_as_one_matrix``)."""
    if _on_tensor_cores(x, w, scales, biases, group_size, bits, mode):
        return tensor_cores.matmul(x, w, scales, biases, group_size, bits)
    if _routed(x, w, scales, biases, group_size, bits, mode):
        return kernel.matmul(x, w, scales, biases, group_size, bits, mode=mode)
    # MLX's own kernel, with or without ours turned off (``MLX_DESK_QMV=0``).
    if w.ndim == 2 and x.ndim > 2 and x.size // max(x.shape[-1], 1) > x.shape[-2] and kernel.available():
        return _as_one_matrix(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )


def fusion_enabled(kind: str) -> bool:
    """Whether the kernel may take the small op ``kind`` (``FUSIONS``) into its products:
    on wherever the kernel runs unless the op's variable is 0."""
    return switch(FUSIONS[kind], "1") != "0" and kernel.enabled()


def prologue_norm(norm: nn.Module, x: mx.array) -> tuple[mx.array, float] | None:
    """(weight, eps) of ``norm`` where the kernel can apply it to ``x`` in its prologue: a plain
    ``nn.RMSNorm`` over x's last axis, its weight in x's dtype, rows that fit the block's
    shared memory (``kernel.norm_fits``) and are at most ``NORM_PROLOGUE_MAX_WIDTH`` wide;
    None otherwise."""
    if type(norm) is not nn.RMSNorm or not fusion_enabled("norm") or x.ndim < 1:
        return None
    if x.shape[-1] > NORM_PROLOGUE_MAX_WIDTH:
        return None
    weight, k = norm.weight, x.shape[-1]
    if weight.shape != (k,) or weight.dtype != x.dtype or not kernel.norm_fits(x.size // max(k, 1), k, x.dtype):
        return None
    return weight, norm.eps


def quantized_fused(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    norm: nn.Module | None = None,
    glu: bool = False,
) -> mx.array | None:
    """The product of ``norm(x)`` (x without a norm; with ``glu``, ``silu(gate) * up`` of it, the
    weight stacking gate rows over up rows) in one launch, the norm in the kernel's prologue
    and the activation in its epilogue; None where the kernel does not take all of it (the
    caller then runs those steps itself). Where the tensor-core kernel takes the product, the
    norm joins it only for rows the row kernel would have taken with it (``MLX_DESK_QMV_MMA_ROWS``'s
    A/B then compares like with like; at its own 8-16 rows the norm stays on its own, as it was timed)."""
    if glu and (not fusion_enabled("glu") or w.shape[0] % 2):
        return None
    on_tensor_cores = _on_tensor_cores(x, w, scales, biases, group_size, bits, mode)
    takes_norm = norm is not None and not (on_tensor_cores and _rows(x, w) in MMA_ROWS)
    prologue = prologue_norm(norm, x) if takes_norm else None
    if (norm is not None and prologue is None) or (norm is None and not glu):
        return None
    if on_tensor_cores:
        return tensor_cores.matmul(x, w, scales, biases, group_size, bits, glu=glu, norm=prologue)
    if not _routed(x, w, scales, biases, group_size, bits, mode, fused=True):
        return None
    return kernel.matmul(x, w, scales, biases, group_size, bits, glu=glu, norm=prologue, mode=mode)


def quantized_matmul_plus(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    residual: mx.array,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``residual + quantized_matmul(x, w, ...)``: one launch where the kernel takes the product
    and the residual is its output's shape and dtype (a decode step's residual stream), else
    the product and the add as they are."""
    if fusion_enabled("residual") and residual.shape == (*x.shape[:-1], w.shape[0]) and residual.dtype == x.dtype:
        if _on_tensor_cores(x, w, scales, biases, group_size, bits, mode):
            return tensor_cores.matmul(x, w, scales, biases, group_size, bits, residual=residual)
        if _routed(x, w, scales, biases, group_size, bits, mode, fused=True):
            return kernel.matmul(x, w, scales, biases, group_size, bits, residual=residual, mode=mode)
    return residual + quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)


def _as_one_matrix(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int, mode: str
) -> mx.array:
    """MLX's product of a [B, L, K] input as one [B * L, K] matrix. MLX's CUDA backend runs a
    [B, L, K] input as B products of L rows, each reading the whole weight: a batch step of 8
    streams ([8, 1, K]) read every matrix 8 times. As one matrix of 8 or more rows its tiled
    kernel reads it about once (docs/qmv.md)."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = mx.quantized_matmul(
        x.reshape(-1, k), w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )
    return y.reshape(*lead, y.shape[-1])


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """``layer(x)``, with an ``nn.QuantizedLinear``'s product routed through ``quantized_matmul``
    where MLX's CUDA backend runs. Other layers (plain, adapter hosts, subclasses) and every
    layer elsewhere are called as they are (so wrappers of ``__call__`` still apply)."""
    if type(layer) is not nn.QuantizedLinear or not kernel.available():
        return layer(x)
    y = quantized_matmul(x, *_packed(layer), **_quantization(layer))
    return y + layer["bias"] if "bias" in layer else y


def linear_plus(layer: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """``residual + linear(layer, x)``, the add in the kernel's epilogue where an
    ``nn.QuantizedLinear`` without a bias takes the kernel (``quantized_matmul_plus``)."""
    if type(layer) is not nn.QuantizedLinear or "bias" in layer or not kernel.available():
        return residual + linear(layer, x)
    return quantized_matmul_plus(x, *_packed(layer), residual, **_quantization(layer))


def embedding_logits(embed: nn.Module, h: mx.array) -> mx.array:
    """``embed.as_linear(h)`` (tied output head), routed like ``linear`` for a quantized embedding."""
    if type(embed) is not nn.QuantizedEmbedding or not kernel.available():
        return embed.as_linear(h)
    return quantized_matmul(h, *_packed(embed), **_quantization(embed))


def _packed(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array | None]:
    """A quantized layer's codes, scales and biases (None in modes without them)."""
    return layer["weight"], layer["scales"], layer.get("biases")


def affine_packed(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array] | None:
    """An affine quantized linear layer's (weight, scales, biases), where it has no bias of its
    own: what a kernel fusing the product into a larger launch reads; None otherwise."""
    if type(layer) is not nn.QuantizedLinear or "bias" in layer or getattr(layer, "mode", "affine") != "affine":
        return None
    return layer["weight"], layer["scales"], layer["biases"]


def _quantization(layer: nn.Module) -> dict:
    """A quantized layer's group size, bits and mode, as the products take them."""
    return {"group_size": layer.group_size, "bits": layer.bits, "mode": getattr(layer, "mode", "affine")}
