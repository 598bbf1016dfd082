"""The next products' weights asked into the GPU's L2 cache while a decode step's attention
runs (CUDA; off until measured: ``MLX_DESK_L2_AHEAD=1`` turns it on).

A decode step's layer reads its weights in four products, and between the first (q/k/v) and
the second (the output product) sit the heads kernel, the cache write and attention: about
25 us a layer on an H200 in which memory reads a few MB of keys and values and otherwise
waits (docs/qmv.md, "MLX's CUDA graphs"). The products after it read at a quarter to a third
of the copy rate, each warp's few chunks waiting their turn on a memory round trip. So here
one small kernel, launched after the heads kernel, asks L2 for the output product's and the
gate/up product's weights (34 MB for qwen3-4b, inside the 50 MB of an H100's or H200's L2)
with Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2``: one instruction a 32 KB piece,
nothing waits for it), and those products then read from L2.

The kernel must run where it is launched, and MLX runs only what an output needs, so it
carries the queries through: its output is the queries, copied (8 KB for qwen3-4b), and
attention reads that. It changes no value. ``MLX_DESK_L2_AHEAD=2`` asks for the down
product's weights as well (48 MB for qwen3-4b: close to the whole L2).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn

from engine.models.base import GATE_UP
from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_cuda import available
from engine.models.stacked import packed_stack

ENV = "MLX_DESK_L2_AHEAD"
# Bytes one prefetch instruction asks for, and the grid that spreads them (and the copy).
PIECE = 32 << 10
BLOCKS = 64
THREADS = 128
# The most arrays one launch prefetches (three products' weights, scales and biases).
MAX_ARRAYS = 9

_SOURCE = """
const long threads = (long)gridDim.x * blockDim.x;
const long id = (long)blockIdx.x * blockDim.x + threadIdx.x;
const char* bases[9] = {A0, A1, A2, A3, A4, A5, A6, A7, A8};
const long sizes[9] = {S0, S1, S2, S3, S4, S5, S6, S7, S8};
#pragma unroll
for (int a = 0; a < 9; ++a) {
  for (long at = id * PIECE; at + 16 <= sizes[a]; at += threads * PIECE) {
    const unsigned bytes = (unsigned)(min((long)PIECE, sizes[a] - at) & ~15L);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                 :: "l"(__cvta_generic_to_global(bases[a] + at)), "r"(bytes) : "memory");
  }
}
for (long i = id; i < QN; i += threads) out[i] = q[i];
"""


def level() -> int:
    """Which products' weights are asked ahead: 0 none (default), 1 the output and gate/up
    products', 2 the down product's too (``MLX_DESK_L2_AHEAD``)."""
    value = switch(ENV, "0")
    return int(value) if value in ("1", "2") else 0


def enabled() -> bool:
    return level() > 0 and available()


def source(count: int) -> str:
    """The kernel's body for ``count`` arrays (inputs a0, a1, ...; the rest of the nine
    null, with size 0)."""
    pointers = [f"(const char*)a{i}" for i in range(count)] + ["nullptr"] * (MAX_ARRAYS - count)
    body = _SOURCE
    for i, pointer in enumerate(pointers):
        body = body.replace(f"A{i},", f"{pointer},").replace(f"A{i}}}", f"{pointer}}}")
    return body


@cache
def _kernel(count: int):
    return cuda_kernel(
        name=f"l2_ahead_{count}",
        input_names=["q", *(f"a{i}" for i in range(count))],
        output_names=["out"],
        source=source(count),
    )


def layer_arrays(layer, x: mx.array) -> list[mx.array]:
    """The weights, scales and biases a decoder layer's products read after attention, in the
    order they read them: the output product's, the stacked gate/up product's and, at level 2,
    the down product's; none where a product is not a plain quantized layer or gate and up are
    not stacked."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    o_proj, down = getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)
    if mlp is None or not all(_quantized(m) for m in (o_proj, down)):
        return []
    gate_up = packed_stack(mlp, GATE_UP, x)
    if gate_up is None:
        return []
    arrays = [o_proj.weight, o_proj.scales, o_proj.biases, *gate_up]
    if level() > 1:
        arrays += [down.weight, down.scales, down.biases]
    return arrays


def _quantized(module) -> bool:
    return type(module) is nn.QuantizedLinear and getattr(module, "biases", None) is not None


def ahead(q: mx.array, arrays: list[mx.array]) -> mx.array:
    """``q`` (copied) after asking L2 for ``arrays`` (each row-contiguous, at most
    ``MAX_ARRAYS``)."""
    arrays = arrays[:MAX_ARRAYS]
    sizes = [a.nbytes for a in arrays] + [0] * (MAX_ARRAYS - len(arrays))
    (out,) = _kernel(len(arrays))(
        inputs=[q, *arrays],
        template=[("PIECE", PIECE), ("QN", q.size), *((f"S{i}", s) for i, s in enumerate(sizes))],
        grid=(BLOCKS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
