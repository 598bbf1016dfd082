"""A decoder layer's tail in one CUDA launch: the attention's output product with the residual
add, the MLP's norm, the gate/up product with its activation, and the down product with the
second residual add. Three launches of the small-row kernel (models.quantized_matmul_cuda)
become one.

Why: a one-token decode step of qwen3-4b runs 7 ops a layer, and its time follows its custom
kernels, not its reads (docs/qmv.md, "The step follows its op count" and "One cache write a
layer"): each costs some microseconds of hand-over on the host and of launch and ramp on the
device whatever it reads.

How: the three products run as phases of one kernel. In each, a block's warps take column
sets of the output together, K split across ``splits`` warps as the product's own launch
splits it (``rows_product`` with its ``set``; one warp a column set, K whole, left the phases
latency-bound: 99 us for qwen3-4b's widths on an H100 against 56), and the grid meets at a
barrier between phases, since each phase reads all of the one before. The barrier is one
word of a buffer of the layer's own (``_Barrier``) whose top bit flips at each crossing, its
low bits counting arrivals back to 0, so the kernel leaves it ready for its next launch and
needs no clearing launch (1.7 us a crossing of 132 blocks on an H100, against 2.4 for a count
and a generation). A grid barrier holds only while every block of the grid is resident at
once, so the grid is one block of ``WARPS`` warps a multiprocessor
(``BLOCKS_PER_MULTIPROCESSOR``): a block of 256 threads always fits a multiprocessor alone (at
most 255 registers a thread, and static shared memory the compiler bounds), whatever the GPU.
MLX does not tell the multiprocessor count, so a probe launch counts them once
(``multiprocessors``): many small blocks, each writing the id of the multiprocessor it ran on.

Each phase computes what its own launch computes (the same device function, the residual
rounded and added as there, the norm as ``block_norm`` computes it in the norm prologue), but
its K splits need not be the separate launch's (``SPLIT``, the block's warps): results equal
them to float rounding, not bit for bit.

Off unless ``MLX_DESK_LAYER_TAIL=1`` (``enabled``), since it was measured slower: on an H100
one launch takes 90-100 us a layer in a chain of qwen3-4b's widths (56 alone, its weights
then mostly in the L2 cache), level with the three launches it replaces, and qwen3-4b decoded
at 273.8 tok/s with it against 332.0 without. One block a multiprocessor keeps too few loads
in flight for the phases' reads, and asking L2 for the next phase's weights ahead did not
help (docs/qmv.md, "A layer's tail in one launch").
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import quantized_matmul_cuda as kernel
from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch
from engine.models.quantized_routing import affine_packed

ENV = "MLX_DESK_LAYER_TAIL"
# The grid: blocks of WARPS warps, BLOCKS_PER_MULTIPROCESSOR on each multiprocessor, all
# resident at once (see above).
BLOCKS_PER_MULTIPROCESSOR = 1
WARPS = 8
# Output columns a warp takes at a time: 2 in the output and down products (their outputs
# are few: 2,560 for qwen3-4b, so more warps share them), 4 weight rows (2 outputs) in gate/up.
COLUMNS = 2
GLU_COLUMNS = 4
# The most warps that split one column set's K (their sums meet in shared memory).
SPLIT = 4
# Rows it takes (a decode step's one, a verify pass's few; batches of 8 and more take the
# tensor-core kernel): their sums live in registers, and the normed rows in shared memory
# (``norm_fits``: 6 of qwen3-4b's, 4 of llama3-8b's).
MAX_ROWS = 6
# Where it was measured (Hopper); the probe's __nanosleep needs 7 and up.
MIN_COMPUTE_CAPABILITY = 9
# The probe's blocks: more than a GPU holds at once in one wave of 32-thread blocks, each
# staying a few microseconds, so every multiprocessor takes some.
PROBE_BLOCKS = 8192
PROBE = """
unsigned sm;
asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
__nanosleep(2000);
if (threadIdx.x == 0) ids[blockIdx.x] = sm;
"""

BARRIER = """
// Every block of the grid waits here until all have arrived, and sees what they wrote before.
// One word: every block adds 1 but block 0, which adds 2^31 - (blocks - 1), so the top bit
// flips once all have arrived and the low bits are back at 0, ready for the next crossing
// and launch (as cooperative groups' grid sync does it).
__device__ __forceinline__ void grid_barrier(unsigned* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    __threadfence();
    const unsigned before = atomicAdd(sync, add);
    while (((before ^ *(volatile unsigned*)sync) & 0x80000000u) == 0) {}
    __threadfence();
  }
  __syncthreads();
}
"""

SOURCE = """
unsigned* sync = const_cast<unsigned*>(barrier);
const int warp = threadIdx.x >> 5;
constexpr int SETS_H = (H + CPW - 1) / CPW;
constexpr int SETS_I = (I + GCPW / 2 - 1) / (GCPW / 2);
for (int g = blockIdx.x; g * (NW / KSO) < SETS_H; g += gridDim.x)
  rows_product<T, R, BITS, GS, CPW, NW, KSO, true>(attn, wo, so, bo, h, KA, H, x, nullptr, 0.f, g * (NW / KSO) + warp / KSO), __syncthreads();
grid_barrier(sync);
__shared__ __align__(16) T normed[R * H];
block_norm<T, R, H, NW>(h, norm, __int_as_float(EPS), normed);
for (int g = blockIdx.x; g * (NW / KSG) < SETS_I; g += gridDim.x)
  rows_product<T, R, BITS, GS, GCPW, NW, KSG, false, true, Sigmoid>(normed, wgu, sgu, bgu, a, H, 2 * I, nullptr, nullptr, 0.f, g * (NW / KSG) + warp / KSG), __syncthreads();
grid_barrier(sync);
for (int g = blockIdx.x; g * (NW / KSD) < SETS_H; g += gridDim.x)
  rows_product<T, R, BITS, GS, CPW, NW, KSD, true>(a, wd, sd, bd, out, I, H, h, nullptr, 0.f, g * (NW / KSD) + warp / KSD), __syncthreads();
"""

# The barrier's buffer, in words: past MLX's pool of buffers of 8 bytes or less (see _Barrier).
COUNTER_WORDS = 64

INPUTS = ("attn", "x", "wo", "so", "bo", "norm", "wgu", "sgu", "bgu", "wd", "sd", "bd", "barrier")


class _Barrier:
    """The grid barrier's counter of one layer (a plain holder: MLX's module tree would count an
    array attribute as a parameter). Filled on the GPU and evaluated at once, so a traced step
    captures it as a constant and every replay's launch reads and leaves the same buffer.

    It is 64 words, not the one it uses: MLX's CUDA allocator gives buffers of 8 bytes or less
    from a pool of managed memory advised read-mostly, where every write (the barrier's
    atomics) collapses the page's copies and every poll faults one back.
    On an H100 a chain of launches took 1.4-1.7 ms each with a two-word counter, where one
    launch with a 64-word counter ran in 56 us and a barrier alone costs 1.7-2.4 us."""

    def __init__(self) -> None:
        self.counter = mx.zeros((COUNTER_WORDS,), dtype=mx.uint32)
        mx.eval(self.counter)


def barrier_of(holder: Any) -> _Barrier:
    """``holder``'s barrier (its ``_layer_tail_barrier``), made on first use. Inside a traced
    step too: its fill depends on nothing traced, so it is evaluated there and the trace keeps
    it as a constant."""
    barrier = holder.__dict__.get("_layer_tail_barrier")
    if barrier is None:
        barrier = _Barrier()
        object.__setattr__(holder, "_layer_tail_barrier", barrier)
    return barrier


def enabled() -> bool:
    """``MLX_DESK_LAYER_TAIL=1`` where the small-row kernel runs on a GPU of compute capability
    9 or more (``MIN_COMPUTE_CAPABILITY``) whose multiprocessors the probe counted."""
    return (
        switch(ENV, "0") == "1"
        and kernel.enabled()
        and _capability() >= MIN_COMPUTE_CAPABILITY
        and multiprocessors() > 0
    )


@cache
def _capability() -> int:
    """The GPU's compute capability (major), asked once: it does not change under a process."""
    try:
        return int(mx.device_info().get("compute_capability_major", 0))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return 0


@cache
def multiprocessors() -> int:
    """The GPU's multiprocessor count, counted once: the distinct ids ``PROBE_BLOCKS`` small
    blocks report (evaluated at once, inside a traced step too: the probe depends on nothing
    traced). 0 where no CUDA kernel can run."""
    try:
        probe = cuda_kernel(name="multiprocessors", input_names=["unused"], output_names=["ids"], source=PROBE)
        (ids,) = probe(
            inputs=[mx.zeros((1,), mx.uint32)],
            grid=(PROBE_BLOCKS * 32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(PROBE_BLOCKS,)],
            output_dtypes=[mx.uint32],
        )
        return len(set(ids.tolist()))
    except (AttributeError, RuntimeError, ValueError):
        return 0


def splits(inputs: int, outputs: int, bits: int, warps: int) -> int:
    """Warps of a block that split one column set's K in a phase: as the product's own launch
    splits it (``k_splits``), at most ``SPLIT`` (1: each warp sums its columns' whole K), and
    a divisor of the block's ``warps``."""
    split = min(SPLIT, kernel.k_splits(inputs, outputs, bits))
    while warps % split:
        split //= 2
    return split


def blocks() -> int:
    """The grid's blocks: ``BLOCKS_PER_MULTIPROCESSOR`` on each multiprocessor."""
    return BLOCKS_PER_MULTIPROCESSOR * multiprocessors()


@cache
def _kernel():
    """The kernel over the small-row kernel's device functions, built once."""
    return cuda_kernel(
        name="layer_tail",
        input_names=list(INPUTS),
        output_names=["out", "h", "a"],
        source=kernel.compact(SOURCE),
        header=kernel.GLU_HEADER + kernel.compact(kernel.DEVICE_FUNCTIONS + BARRIER),
    )


def takes(attn: mx.array, x: mx.array, o_proj: nn.Module, norm: nn.Module, gate_up: tuple, down: nn.Module) -> bool:
    """Whether one launch computes this tail: attention rows ``attn`` [..., KA] and the residual
    ``x`` [..., H] of at most ``MAX_ROWS`` rows, the output and down products affine quantized
    layers of one bit width and group size, ``gate_up`` their stacked (weight, scales, biases)
    of the same quantization, and ``norm`` an RMSNorm the kernel's prologue computes."""
    hidden, rows = x.shape[-1], x.size // max(x.shape[-1], 1)
    packed = (affine_packed(o_proj), affine_packed(down))
    if None in packed or not (1 <= rows <= MAX_ROWS) or attn.size != rows * attn.shape[-1]:
        return False
    bits, group = o_proj.bits, o_proj.group_size
    if (down.bits, down.group_size) != (bits, group) or type(norm) is not nn.RMSNorm:
        return False
    wgu, sgu, bgu = gate_up
    intermediate = wgu.shape[0] // 2
    return (
        norm.weight.shape == (hidden,)
        and norm.weight.dtype == x.dtype == attn.dtype
        and kernel.norm_fits(rows, hidden, x.dtype)
        and all(a.dtype == x.dtype for p in packed for a in p[1:])
        and sgu.dtype == bgu.dtype == x.dtype
        and o_proj["weight"].shape == (hidden, attn.shape[-1] * bits // 32)
        and wgu.shape == (2 * intermediate, hidden * bits // 32)
        and sgu.shape == (2 * intermediate, hidden // group)
        and down["weight"].shape == (hidden, intermediate * bits // 32)
        and hidden % group == 0
        and bits in kernel.BITS
        and group in kernel.GROUP_SIZES
        and x.dtype in kernel.DTYPES
        and attn.shape[-1] % group == 0
        and intermediate % group == 0
    )


def template_of(
    rows: int, heads_width: int, hidden: int, intermediate: int, bits: int, group: int, dtype: mx.Dtype, eps: float
) -> list[tuple[str, Any]]:
    """The kernel's template constants for a tail of these widths and quantization."""
    return [
        ("T", dtype),
        ("R", rows),
        ("BITS", bits),
        ("GS", group),
        ("NW", WARPS),
        ("CPW", COLUMNS),
        ("GCPW", GLU_COLUMNS),
        ("KSO", splits(heads_width, hidden, bits, WARPS)),
        ("KSG", splits(hidden, 2 * intermediate, bits, WARPS)),
        ("KSD", splits(intermediate, hidden, bits, WARPS)),
        ("KA", heads_width),
        ("H", hidden),
        ("I", intermediate),
        ("EPS", kernel.float_bits(eps)),
    ]


def layer_tail(
    attn: mx.array, x: mx.array, o_proj: nn.Module, norm: nn.Module, gate_up: tuple, down: nn.Module, holder: Any
) -> mx.array:
    """``h + down(silu(gate(n)) * up(n))`` for ``h = x + o_proj(attn)`` and ``n = norm(h)``, in
    one launch (the caller checks ``takes``). ``holder``: the object that keeps the layer's
    barrier (``barrier_of``)."""
    barrier = barrier_of(holder)
    hidden, rows = x.shape[-1], x.size // x.shape[-1]
    wgu, sgu, bgu = gate_up
    intermediate = wgu.shape[0] // 2
    inputs = [attn, x, *affine_packed(o_proj), norm.weight, wgu, sgu, bgu, *affine_packed(down), barrier.counter]
    template = template_of(
        rows, attn.shape[-1], hidden, intermediate, o_proj.bits, o_proj.group_size, x.dtype, norm.eps
    )
    out, _, _ = _kernel()(
        inputs=inputs,
        template=template,
        grid=(blocks() * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[x.shape, (rows, hidden), (rows, intermediate)],
        output_dtypes=[x.dtype] * 3,
    )
    return out
