"""The next products' weights asked into the GPU's L2 cache while a decode step's attention
runs (CUDA; off: ``MLX_DESK_L2_AHEAD=1`` turns it on).

Measured no faster on an H100 (docs/qmv.md, "Memory waits"): qwen3-4b decoded at 213.8 tok/s
at level 1, 179.8 at level 2 and 210.4 with the prefetch in its own kernel, against 227.2
and 214.6 without, in one run; llama3-8b at 157.7 against 273.3, its level 1 asking for
75 MB, more than L2 holds.

A decode step's layer reads its weights in four products, and between the first (q/k/v) and
the second (the output product) sit the heads kernel, the cache write and attention: about
25 us a layer on an H200 in which memory reads a few MB of keys and values and otherwise
waits (docs/qmv.md, "MLX's CUDA graphs"). The products after it read at a quarter to a third
of the copy rate, each warp's few chunks waiting their turn on a memory round trip. So the
step asks L2 for the output product's and the gate/up product's weights (34 MB for qwen3-4b,
inside the 50 MB of an H100's or H200's L2) with Hopper's bulk prefetch
(``cp.async.bulk.prefetch.L2``: one instruction a 32 KB piece, nothing waits for it), and
those products then read from L2. ``MLX_DESK_L2_AHEAD=2`` asks for the down product's
weights as well (48 MB for qwen3-4b: close to the whole L2).

Where the prefetch runs: by default inside the heads kernel's launch (the step names the
arrays with ``asking``, the heads kernel ``take``s them and prepends the prefetch to its own
work), so it costs no launch. With ``MLX_DESK_L2_AHEAD_IN_HEADS=0``, or where no heads kernel
follows the q/k/v product, what was ``left`` goes to a small kernel of its own. MLX runs only
what an output needs, so that kernel carries the queries through: its output is the
queries, copied (8 KB for qwen3-4b), and attention reads that. Neither changes a value.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import mlx.core as mx

from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_cuda import available

ENV = "MLX_DESK_L2_AHEAD"
# Where the prefetch runs: in the heads kernel's launch where one follows the q/k/v product
# (default), or in its own kernel (``MLX_DESK_L2_AHEAD_IN_HEADS=0``).
IN_HEADS_ENV = "MLX_DESK_L2_AHEAD_IN_HEADS"
# Bytes one prefetch instruction asks for, and the grid that spreads them (and the copy).
PIECE = 32 << 10
BLOCKS = 64
THREADS = 128
# The most arrays one launch prefetches (three products' weights, scales and biases).
MAX_ARRAYS = 9

# Thread ``id`` of ``threads`` asks for pieces id, id + threads, ... of each array (a piece's
# size rounded down to 16 bytes, as the instruction takes it; the prefetch is a hint, so the
# last bytes of an array whose size is not a multiple of 16 may be left out).
_PREFETCH = """
{
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
}
"""

_COPY = """
for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < QN; i += (long)gridDim.x * blockDim.x) out[i] = q[i];
"""


def level() -> int:
    """Which products' weights are asked ahead: 0 none (default), 1 the output and gate/up
    products', 2 the down product's too (``MLX_DESK_L2_AHEAD``)."""
    value = switch(ENV, "0")
    return int(value) if value in ("1", "2") else 0


def enabled() -> bool:
    return level() > 0 and available()


def prefetch_source(count: int) -> str:
    """The prefetch of ``count`` arrays (inputs a0, a1, ...; the rest of the nine null, with
    size 0) as a block of any kernel's body: every thread of the grid takes a share. Its
    template constants: PIECE and the sizes S0-S8 (``constants``)."""
    pointers = [f"(const char*)a{i}" for i in range(count)] + ["nullptr"] * (MAX_ARRAYS - count)
    body = _PREFETCH
    for i, pointer in enumerate(pointers):
        body = body.replace(f"A{i},", f"{pointer},").replace(f"A{i}}}", f"{pointer}}}")
    return body


def source(count: int) -> str:
    """The standalone kernel's body: the prefetch, then the queries' copy."""
    return prefetch_source(count) + _COPY


def constants(arrays: list[mx.array]) -> list[tuple[str, int]]:
    """The prefetch's template constants for ``arrays``: the piece and each array's bytes."""
    sizes = [a.nbytes for a in arrays] + [0] * (MAX_ARRAYS - len(arrays))
    return [("PIECE", PIECE), *((f"S{i}", size) for i, size in enumerate(sizes))]


# Arrays a traced step asks ahead of the kernel it builds next (``asking``): the heads kernel
# takes them into its own launch (``take``), so no launch is added; what no kernel took, the
# caller prefetches with the standalone kernel.
_asked: list[mx.array] = []


@contextmanager
def asking(arrays: list[mx.array]):
    """Offer ``arrays`` to the kernels built inside the block (a step is traced on one thread)."""
    _asked[:] = arrays[:MAX_ARRAYS]
    try:
        yield
    finally:
        _asked.clear()


def take() -> list[mx.array]:
    """The arrays offered and not yet taken (none after this), unless ``MLX_DESK_L2_AHEAD_IN_HEADS=0``
    keeps them for the standalone kernel."""
    if not _asked or switch(IN_HEADS_ENV, "1") == "0":  # nothing asked: the usual case
        return []
    arrays = list(_asked)
    _asked.clear()
    return arrays


def left() -> list[mx.array]:
    """The arrays offered that no kernel took."""
    return list(_asked)


@cache
def _kernel(count: int):
    return cuda_kernel(
        name=f"l2_ahead_{count}",
        input_names=["q", *(f"a{i}" for i in range(count))],
        output_names=["out"],
        source=source(count),
    )


def ahead(q: mx.array, arrays: list[mx.array]) -> mx.array:
    """``q`` (copied) after asking L2 for ``arrays`` (each row-contiguous, at most
    ``MAX_ARRAYS``)."""
    arrays = arrays[:MAX_ARRAYS]
    (out,) = _kernel(len(arrays))(
        inputs=[q, *arrays],
        template=[("QN", q.size), *constants(arrays)],
        grid=(BLOCKS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
