"""What one op of a decode step costs, op by op: a dependent chain of each op alone (each
takes the previous one's output), timed as the host builds it, as ``async_eval`` hands it
over, and as the device finishes after the hand-over (the tail). Where the tail is near zero
the host is the bound; where it is large, the device. Per op, medians of 5 chains of 200.

    PYTHONPATH=. python3 tests/gpu/op_chain.py

Needs MLX's CUDA build (the product kernels are ours, in engine/models/quantized_matmul_cuda.py).
"""

import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from engine.cli.roofline import copy_bandwidth
from engine.models import quantized_matmul_cuda as products

EPS = 1e-6


def timed(name: str, make: Callable[[int], mx.array], n: int = 200, reps: int = 7) -> None:
    runs = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        y = make(n)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        runs.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    build, hand_over, tail, total = (statistics.median(c) * 1e6 / n for c in zip(*runs[2:], strict=True))
    print(f"{name:36s} build {build:6.2f}  hand-over {hand_over:6.2f}  tail {tail:6.2f}  total {total:6.2f} us/op")


def quantized(n: int, k: int) -> tuple[mx.array, mx.array, mx.array]:
    w, scales, biases = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size=64, bits=4)
    mx.eval(w, scales, biases)
    return w, scales, biases


def chained(first: mx.array, op: Callable[[mx.array, int], mx.array]) -> Callable[[int], mx.array]:
    def make(n: int) -> mx.array:
        x = first
        for i in range(n):
            x = op(x, i)
        return x

    return make


def main() -> None:
    hidden, wide = 2560, 9728  # qwen3-4b
    x = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    norm = mx.ones((hidden,), mx.bfloat16)
    timed("add", chained(x, lambda y, i: y + 1))
    timed("rms_norm", chained(x, lambda y, i: mx.fast.rms_norm(y, norm, EPS)))
    copy = mx.fast.cuda_kernel(
        name="one_line_copy",
        input_names=["x"],
        output_names=["out"],
        source="unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < N) out[i] = x[i];\n",
    )
    timed(
        "custom kernel, one-line copy",
        chained(
            x,
            lambda y, i: copy(
                inputs=[y],
                template=[("N", hidden)],
                grid=(hidden, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[y.shape],
                output_dtypes=[y.dtype],
            )[0],
        ),
    )
    narrow = [quantized(512, 512) for _ in range(8)]
    x512 = mx.random.normal((1, 1, 512)).astype(mx.bfloat16)
    timed("product 512->512", chained(x512, lambda y, i: products.matmul(y, *narrow[i % 8], 64, 4)))
    square = [quantized(hidden, hidden) for _ in range(8)]
    timed(f"product {hidden}->{hidden}", chained(x, lambda y, i: products.matmul(y, *square[i % 8], 64, 4)))
    timed(
        f"product {hidden}->{hidden} + residual",
        chained(x, lambda y, i: products.matmul(y, *square[i % 8], 64, 4, residual=y)),
    )
    # qwen3-4b's MLP, 36 layers of their own weights (read from memory, not the L2 cache).
    gate_up = [quantized(2 * wide, hidden) for _ in range(36)]
    down = [quantized(hidden, wide) for _ in range(36)]

    def mlp(y: mx.array, i: int) -> mx.array:
        h = products.matmul(y, *gate_up[i % 36], 64, 4, glu=True, norm=(norm, EPS))
        return products.matmul(h, *down[i % 36], 64, 4, residual=y)

    timed("MLP layer (2 kernels), per kernel", lambda n: chained(x, mlp)(n // 2))
    layer_bytes = sum(a.nbytes for t in gate_up + down for a in t) / 36
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 8, 576, 128)).astype(mx.bfloat16) for _ in range(2))
    timed(
        "attention, 1 query over 576",
        chained(q, lambda y, i: mx.fast.scaled_dot_product_attention(y, k, v, scale=0.088)),
    )
    buffer = mx.zeros((2, 1, 8, 1024, 128), mx.bfloat16)
    kv = mx.random.normal((2, 1, 8, 1, 128)).astype(mx.bfloat16)
    mx.eval(buffer, kv)

    def written(n: int) -> mx.array:
        b = buffer
        for i in range(n):
            b[:, :, :, i : i + 1] = kv
        return b

    timed("slice update of stacked keys/values", written)
    rate = copy_bandwidth()
    print(
        f"copy rate {rate / 1e9:.0f} GB/s; an MLP layer's {layer_bytes / 1e6:.1f} MB take {layer_bytes / rate * 1e6:.1f} us at it"
    )


if __name__ == "__main__":
    main()
