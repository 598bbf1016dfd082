"""CUDA kernels' own source built for the CPU with g++: a few definitions that stand in for
CUDA's (each lane a thread, a warp's shuffles meeting at a barrier of its 32 threads,
``__syncthreads`` at one of the block's, blocks run one after another), the activation
types as C++ spells them, and the build."""

from __future__ import annotations

import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PRELUDE = r"""
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
using std::min;
struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct bf16 {  // bfloat16: float's top half, rounded to nearest even
  uint16_t v;
  bf16() = default;
  bf16(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); v = u >> 16; }
  operator float() const { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
};
inline float __int_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
struct Index { int x, y, z; };
thread_local Index threadIdx, blockIdx;
std::barrier<>* warp_barriers[32];
std::barrier<>* block_barrier;
float slots[1024];
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int t = threadIdx.x, w = t >> 5;
  slots[t] = v;
  warp_barriers[w]->arrive_and_wait();
  const float r = slots[(w << 5) | ((t & 31) ^ o)];
  warp_barriers[w]->arrive_and_wait();
  return r;
}
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
using Shape = std::array<int32_t, 8>;
static std::vector<char> slurp(const char* path) {
  std::vector<char> bytes;
  FILE* f = fopen(path, "rb");
  char buf[65536];
  for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) bytes.insert(bytes.end(), buf, buf + n);
  fclose(f);
  return bytes;
}
// One block (blockIdx x, y, z) of ``warps`` warps: a thread per lane, each running ``body``.
template <typename F>
static void run_block(int warps, int x, int y, int z, F body) {
  std::vector<std::barrier<>*> bars;
  for (int i = 0; i < warps; ++i) warp_barriers[i] = bars.emplace_back(new std::barrier<>(32));
  std::barrier<> block(warps * 32);
  block_barrier = &block;
  std::vector<std::thread> threads;
  for (int t = 0; t < warps * 32; ++t)
    threads.emplace_back([&, t] {
      threadIdx.x = t;
      blockIdx.x = x;
      blockIdx.y = y;
      blockIdx.z = z;
      body();
    });
  for (auto& t : threads) t.join();
  for (auto* bar : bars) delete bar;
}
template <typename F>
static void run_block(int warps, int x, int y, F body) {
  run_block(warps, x, y, 0, body);
}
"""

# A product kernel (x, w, scales, biases -> out) run over its blocks: arguments rows, K, N, x
# shifted by that many elements (unaligned loads), warps a block, warps splitting K, columns a
# warp set owns (blocks = N over warps / splits * columns).
PRODUCT_DRIVER = r"""
static void kernel(const T* x, const uint32_t* w, const Shape w_shape, const T* scales, const T* biases, T* out) {
  CONSTANTS
  SOURCE
}
int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), K = atoi(argv[2]), N = atoi(argv[3]), shift = atoi(argv[4]);
  const int warps = atoi(argv[5]), splits = atoi(argv[6]), columns = atoi(argv[7]);
  auto xb = slurp("x.bin"), wb = slurp("w.bin"), sb = slurp("s.bin"), bb = slurp("b.bin");
  std::vector<T> xs((size_t)rows * K + 8);  // shifted by `shift` elements: unaligned loads
  memcpy(xs.data() + shift, xb.data(), xb.size());
  std::vector<uint32_t> ws(wb.size() / 4);
  memcpy(ws.data(), wb.data(), wb.size());
  std::vector<T> out((size_t)rows * N);
  Shape wsh{};
  wsh[0] = N; wsh[1] = (int)(ws.size() / N);
  const int per_block = warps / splits * columns, blocks = (N + per_block - 1) / per_block;
  for (int b = 0; b < blocks; ++b)
    run_block(warps, b, 0, [&] {
      kernel(xs.data() + shift, ws.data(), wsh, (const T*)sb.data(), (const T*)bb.data(), out.data());
    });
  FILE* f = fopen("out.bin", "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fclose(f);
}
"""

# The same product with a residual added in its epilogue (the kernels' ``residual``; r.bin).
RESIDUAL_DRIVER = (
    PRODUCT_DRIVER.replace(
        "const T* scales, const T* biases, T* out) {", "const T* scales, const T* biases, const T* residual, T* out) {"
    )
    .replace(
        "(const T*)sb.data(), (const T*)bb.data(), out.data());",
        "(const T*)sb.data(), (const T*)bb.data(), (const T*)rb.data(), out.data());",
    )
    .replace('auto xb = slurp("x.bin"),', 'auto rb = slurp("r.bin");\n  auto xb = slurp("x.bin"),')
)


# The gate/up product with the activation in its epilogue (the kernels' ``glu``): N = 2I weight
# rows, I outputs, blocks across the outputs. MLX's Sigmoid stands in as the CPU computes it.
GLU_DRIVER = (
    "struct Sigmoid {\n  template <typename U> U operator()(U x) {\n"
    "    const float y = 1.0f / (1.0f + std::exp(std::fabs((float)x)));\n"
    "    return U((float)x < 0 ? y : 1.0f - y);\n  }\n};\n"
    + PRODUCT_DRIVER.replace(
        "std::vector<T> out((size_t)rows * N);", "std::vector<T> out((size_t)rows * N / 2);"
    ).replace("blocks = (N + per_block - 1) / per_block;", "blocks = (N / 2 + per_block - 1) / per_block;")
)


# The gate/up product with the RMSNorm in its prologue and the activation in its epilogue (the
# kernels' ``norm``; n.bin: the norm's weight). For the plain product replace "N / 2" by "N".
NORM_DRIVER = (
    GLU_DRIVER.replace(
        "const T* scales, const T* biases, T* out) {", "const T* scales, const T* biases, const T* norm, T* out) {"
    )
    .replace(
        "(const T*)sb.data(), (const T*)bb.data(), out.data());",
        "(const T*)sb.data(), (const T*)bb.data(), (const T*)nb.data(), out.data());",
    )
    .replace('auto xb = slurp("x.bin"),', 'auto nb = slurp("n.bin");\n  auto xb = slurp("x.bin"),')
)


CPP_TYPE = {mx.float32: "float", mx.float16: "_Float16", mx.bfloat16: "bf16"}


def raw_values(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def compile_source(folder, name: str, source: str, command: list[str]) -> str:
    """``source`` written to ``folder``/``name`` and built there by ``command``; the compiler's
    stderr (what the assembler reports, for nvcc). Fails the test where it does not build."""
    (folder / name).write_text(source)
    built = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    return built.stderr


def build(tmp_path, source: str) -> None:
    """``source`` built as ``tmp_path``/kernel."""
    compile_source(
        tmp_path, "kernel.cpp", source, ["g++", "-std=c++20", "-O1", "-pthread", "-w", "kernel.cpp", "-o", "kernel"]
    )


def normed_product(x, weight, eps, wq, scales, biases, glu: bool) -> mx.array:
    """The norm prologues' referee: MLX's product of ``mx.fast.rms_norm(x, weight, eps)`` (of x
    itself where ``weight`` is None) by a 4-bit g64 weight in float32; with ``glu`` the weight
    stacks gate over up rows and this is ``silu(gate) * up``."""
    rows = x if weight is None else mx.fast.rms_norm(x, weight, eps)
    f32 = [a.astype(mx.float32) for a in (rows, scales, biases)]
    y = mx.quantized_matmul(f32[0], wq, f32[1], f32[2], transpose=True, group_size=64, bits=4)
    if glu:
        gate, up = mx.split(y, 2, axis=-1)
        y = nn.silu(gate) * up
    return y
