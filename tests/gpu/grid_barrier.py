"""What a grid barrier costs inside one launch, and what the layer tail (models.layer_tail_cuda)
costs with each barrier and with none (its phases alone: wrong results, the phases' own time).
A chain of 200 dependent launches, microseconds a launch, medians of 5.

    PYTHONPATH=. python3 tests/gpu/grid_barrier.py

Needs MLX's CUDA build on a GPU of compute capability 9 or more.
"""

import statistics
import sys
import time

import mlx.core as mx

from engine.models import layer_tail_cuda as tail

# The barrier before the one-word flip (tail.BARRIER): a count and a generation; the last to
# arrive resets the count and moves the generation on, which the others wait for.
COUNT = """
__device__ __forceinline__ void grid_barrier(unsigned* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* generation = sync + 1;
    const unsigned seen = *generation;
    __threadfence();
    if (atomicAdd(sync, 1u) == gridDim.x - 1) {
      atomicExch(sync, 0u);
      __threadfence();
      atomicAdd(sync + 1, 1u);
    } else {
      while (*generation == seen) __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}
"""
SPIN = COUNT.replace("__nanosleep(64);", "{}")
FLIP = tail.BARRIER
VARIANTS = {"count+generation, sleep 64": COUNT, "count+generation, spin": SPIN, "flip (cg-style)": FLIP}

ONLY = """
unsigned* sync = const_cast<unsigned*>(barrier);
for (int i = 0; i < N; ++i) grid_barrier(sync);
if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = x[0] + 1.f;
"""


def timed(make, n: int = 200, reps: int = 7) -> float:
    runs = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(make(n))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[2:]) * 1e6 / n


def barrier_only(source: str, barriers: int, blocks: int) -> float:
    kernel = mx.fast.cuda_kernel(
        name="barrier_only",
        input_names=["x", "barrier"],
        output_names=["out"],
        source=ONLY,
        header=source,
    )
    counter = mx.zeros((64,), mx.uint32)
    x0 = mx.zeros((1,), mx.float32)

    def make(n: int) -> mx.array:
        x = x0
        for _ in range(n):
            (x,) = kernel(
                inputs=[x, counter],
                template=[("N", barriers)],
                grid=(blocks * 256, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.float32],
            )
        return x

    return timed(make)


STAMP = """
#define STAMP(i) if (threadIdx.x == 0) { unsigned long long t_; \\
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); times[blockIdx.x * 6 + (i)] = t_; }
"""


def timeline(barrier: str) -> None:
    """When each block starts, reaches and leaves each barrier, and ends (one launch of the
    layer tail at qwen3-4b's widths): nanoseconds from the first start, min/median/max over blocks."""
    import layer_tail_sweep as sweep  # noqa: PLC0415 (beside this file)
    import numpy as np  # noqa: PLC0415

    first, second = (f"__syncthreads(); STAMP({i}); grid_barrier(sync); STAMP({i + 1});" for i in (1, 3))
    source = tail.SOURCE.replace("grid_barrier(sync);", "@", 1).replace("grid_barrier(sync);", second)
    source = "STAMP(0);\n" + source.replace("@", first) + "__syncthreads(); STAMP(5);\n"
    kernel = mx.fast.cuda_kernel(
        name="layer_tail_timeline",
        input_names=list(tail.INPUTS),
        output_names=["out", "h", "a", "times"],
        source=source,
        header=tail.kernel.GLU_HEADER + STAMP + tail.kernel.DEVICE_FUNCTIONS + barrier,
    )
    heads_width, hidden, intermediate = sweep.WIDTHS["qwen3-4b"]
    o_proj, gate_up, down = (
        sweep.quantized(heads_width, hidden),
        sweep.quantized(hidden, 2 * intermediate),
        sweep.quantized(intermediate, hidden),
    )
    norm = mx.ones((hidden,), mx.bfloat16)
    attn = mx.random.normal((1, heads_width)).astype(mx.bfloat16)
    x = mx.random.normal((1, hidden)).astype(mx.bfloat16)
    counter = mx.zeros((64,), mx.uint32)
    inputs = [attn, x, o_proj["weight"], o_proj["scales"], o_proj["biases"], norm]
    inputs += [gate_up["weight"], gate_up["scales"], gate_up["biases"], down["weight"], down["scales"], down["biases"]]
    blocks = tail.blocks()
    for _ in range(5):
        *_, times = kernel(
            inputs=[*inputs, counter],
            template=tail.template_of(1, heads_width, hidden, intermediate, 4, 64, mx.bfloat16, 1e-6),
            grid=(blocks * tail.WARPS * 32, 1, 1),
            threadgroup=(tail.WARPS * 32, 1, 1),
            output_shapes=[(1, hidden), (1, hidden), (1, intermediate), (blocks * 6,)],
            output_dtypes=[mx.bfloat16] * 3 + [mx.uint64],
        )
        mx.eval(times)
    t = np.array(times).reshape(blocks, 6).astype(np.int64)
    t -= t[:, 0].min()
    names = ["start", "at barrier 1", "past barrier 1", "at barrier 2", "past barrier 2", "end"]
    for i, name in enumerate(names):
        col = t[:, i]
        print(f"  {name:16s} ns  min {col.min():8d}  median {int(np.median(col)):8d}  max {col.max():8d}")


def main() -> None:
    if "--timeline" in sys.argv:
        for warps in (8, 16):
            tail.WARPS = warps
            print(f"== timeline, {warps} warps a block, barrier: flip", flush=True)
            timeline(FLIP)
        return
    sms = tail.multiprocessors()
    print(f"{sms} multiprocessors")
    for name, source in VARIANTS.items():
        cells = [f"{barrier_only(source, b, g):7.2f}" for g in (sms // 4, sms) for b in (0, 2, 8)]
        print(
            f"{name:28s} us a launch, {sms // 4} blocks x 0/2/8 barriers, {sms} x 0/2/8: {' '.join(cells)}", flush=True
        )
    if "--layer" not in sys.argv:
        return
    sys.argv = [sys.argv[0], "qwen3-4b"]
    import layer_tail_sweep as sweep  # noqa: PLC0415 (beside this file)

    sweep.GRIDS = sweep.GRIDS[:3]
    source = tail.SOURCE
    for name, barrier in [*VARIANTS.items(), ("none (phases alone)", "__device__ void grid_barrier(unsigned*) {}")]:
        print(f"== layer tail, barrier: {name}", flush=True)
        tail.BARRIER, tail.SOURCE = barrier, source
        sweep.main()


if __name__ == "__main__":
    main()
