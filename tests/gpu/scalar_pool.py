"""What a decode step pays for the small arrays the host makes every step: MLX's CUDA allocator
gives buffers of 8 bytes or less from a pool of managed memory advised read-mostly, so a
position made on the host (a 4-byte array) and read by the GPU may fault its page each step.
Steps of 8 dependent one-line kernels, each evaluated and read back as a decode step's token
is, with the position made each of three ways: a 4-byte array from the host, a 16-byte one
(past the pool), and kept on the GPU (the step adds one to the last). Microseconds a step,
medians of 5 runs of 200 steps.

    PYTHONPATH=. python3 tests/gpu/scalar_pool.py

Needs MLX's CUDA build.
"""

import statistics
import time

import mlx.core as mx

KERNELS = 8
SOURCE = "unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < N) out[i] = x[i] + (float)pos[0];\n"


def main() -> None:
    add = mx.fast.cuda_kernel(name="add_position", input_names=["x", "pos"], output_names=["out"], source=SOURCE)
    width = 2560
    x0 = mx.zeros((width,), mx.float32)
    mx.eval(x0)

    def step(x: mx.array, pos: mx.array) -> mx.array:
        for _ in range(KERNELS):
            (x,) = add(
                inputs=[x, pos],
                template=[("N", width)],
                grid=(width, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[x.shape],
                output_dtypes=[x.dtype],
            )
        return x

    def run(position) -> float:
        runs = []
        for _ in range(7):
            x, pos = x0, mx.array([0], mx.int32)
            mx.eval(pos)
            start = time.perf_counter()
            for i in range(200):
                pos = position(i, pos)
                x = step(x, pos)
                token = mx.argmax(x)  # 4 bytes, from the pool too, as a sampled token is
                mx.eval(token)
                token.item()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs[2:]) / 200 * 1e6

    print(f"position from the host, 4 bytes   {run(lambda i, _: mx.array([i], mx.int32)):7.1f} us a step")
    print(f"position from the host, 16 bytes  {run(lambda i, _: mx.array([i, 0, 0, 0], mx.int32)):7.1f} us a step")
    print(f"position kept on the GPU          {run(lambda i, last: last + 1):7.1f} us a step")


if __name__ == "__main__":
    main()
