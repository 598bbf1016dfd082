"""The layer-tail kernel's own source (models.layer_tail_cuda) run on the CPU: its three phases
(output product with the residual, norm and gate/up with the activation, down with the second
residual), their warps taking column sets in turn, and the grid barrier between them, against
MLX's own ops. One block here (blocks run one after another on the CPU, so a barrier across
several would never open); the GPU tests run the whole grid. Skipped without g++."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import layer_tail_cuda as tail
from engine.models import quantized_matmul_cuda as qmv
from tests.engine.models.cuda_on_cpu import CPP_TYPE, PRELUDE, build, raw_values

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel for the CPU")

_TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

# What CUDA gives the barrier, for one block; MLX's Sigmoid as the CPU computes it.
_GRID = r"""
Index gridDim{1, 1};
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) {}
struct Sigmoid {
  template <typename U> U operator()(U x) {
    const float y = 1.0f / (1.0f + std::exp(std::fabs((float)x)));
    return U((float)x < 0 ? y : 1.0f - y);
  }
};
"""

_DRIVER = r"""
template <typename U> static std::vector<U> load(const char* name) {
  auto bytes = slurp(name);
  std::vector<U> v(bytes.size() / sizeof(U) + 1);
  memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}
static void kernel(const T* attn, const T* x, const uint32_t* wo, const T* so, const T* bo, const T* norm,
                   const uint32_t* wgu, const T* sgu, const T* bgu, const uint32_t* wd, const T* sd, const T* bd,
                   const uint32_t* barrier, T* out, T* h, T* a) {
  CONSTANTS
  SOURCE
}
int main() {
  auto attn = load<T>("attn.bin"), x = load<T>("x.bin"), so = load<T>("so.bin"), bo = load<T>("bo.bin");
  auto norm = load<T>("norm.bin"), sgu = load<T>("sgu.bin"), bgu = load<T>("bgu.bin");
  auto sd = load<T>("sd.bin"), bd = load<T>("bd.bin");
  auto wo = load<uint32_t>("wo.bin"), wgu = load<uint32_t>("wgu.bin"), wd = load<uint32_t>("wd.bin");
  std::vector<uint32_t> barrier{0, 0};
  std::vector<T> out(ROWS * HIDDEN), h(ROWS * HIDDEN), a(ROWS * INTER);
  for (int launch = 0; launch < 2; ++launch)  // twice: the barrier is left as found
    run_block(WARPS, 0, 0, [&] {
      kernel(attn.data(), x.data(), wo.data(), so.data(), bo.data(), norm.data(), wgu.data(), sgu.data(),
             bgu.data(), wd.data(), sd.data(), bd.data(), barrier.data(), out.data(), h.data(), a.data());
    });
  printf("%u %u\n", barrier[0], barrier[1]);
  FILE* f = fopen("out.bin", "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fclose(f);
}
"""


def _quantized(key, n: int, k: int, dtype, bits: int, group: int):
    w = (mx.random.normal((n, k), key=key) * k**-0.5).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


@pytest.mark.parametrize(
    "rows, heads_width, hidden, intermediate, bits, group, dtype, warps",
    [
        (1, 256, 192, 320, 4, 64, mx.float32, 2),
        (1, 128, 256, 384, 8, 32, mx.bfloat16, 3),
        (3, 256, 128, 256, 4, 128, mx.float16, 2),
        (6, 128, 128, 192, 4, 32, mx.bfloat16, 2),
    ],
    ids=str,
)
def test_the_layer_tail_equals_the_products_norm_and_activation_it_joins(
    tmp_path, rows, heads_width, hidden, intermediate, bits, group, dtype, warps
):
    keys = mx.random.split(mx.random.key(rows + hidden + bits), 6)
    wo, so, bo = _quantized(keys[0], hidden, heads_width, dtype, bits, group)
    wgu, sgu, bgu = _quantized(keys[1], 2 * intermediate, hidden, dtype, bits, group)
    wd, sd, bd = _quantized(keys[2], hidden, intermediate, dtype, bits, group)
    attn = mx.random.normal((rows, heads_width), key=keys[3]).astype(dtype)
    x = (3 * mx.random.normal((rows, hidden), key=keys[4])).astype(dtype)
    weight = (1 + 0.3 * mx.random.normal((hidden,), key=keys[5])).astype(dtype)
    eps = 1e-5
    arrays = {"attn": attn, "x": x, "so": so, "bo": bo, "norm": weight, "sgu": sgu, "bgu": bgu, "sd": sd, "bd": bd}
    for name, a in arrays.items():
        raw_values(a).tofile(tmp_path / f"{name}.bin")
    for name, a in {"wo": wo, "wgu": wgu, "wd": wd}.items():
        np.array(a).tofile(tmp_path / f"{name}.bin")
    constants = (
        f"constexpr int R = {rows}; constexpr int BITS = {bits}; constexpr int GS = {group}; "
        f"constexpr int NW = {warps}; constexpr int CPW = {tail.COLUMNS}; constexpr int GCPW = {tail.GLU_COLUMNS}; "
        f"constexpr int KA = {heads_width}; constexpr int H = {hidden}; constexpr int I = {intermediate}; "
        f"constexpr int EPS = {qmv.float_bits(eps)};"
    )
    program = (
        PRELUDE
        + _GRID
        + qmv.compact(qmv.DEVICE_FUNCTIONS + tail.BARRIER)
        + f"using T = {CPP_TYPE[dtype]};\nconstexpr int ROWS = {rows}, HIDDEN = {hidden}, INTER = {intermediate}, WARPS = {warps};\n"
        + _DRIVER.replace("CONSTANTS", constants).replace("SOURCE", qmv.compact(tail.SOURCE))
    )
    build(tmp_path, program)
    ran = subprocess.run(["./kernel"], cwd=tmp_path, check=True, timeout=120, capture_output=True, text=True)
    assert ran.stdout.split() == ["0", "4"]  # two launches, two barriers each: the count back at 0
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint16 if dtype == mx.bfloat16 else raw_values(x).dtype)
    got = mx.array(raw.reshape(rows, hidden))
    got = got.view(mx.bfloat16) if dtype == mx.bfloat16 else got

    def product(v, w, s, b):
        return mx.quantized_matmul(v, w, s, b, transpose=True, group_size=group, bits=bits)

    h = x + product(attn, wo, so, bo)
    gate, up = mx.split(product(mx.fast.rms_norm(h, weight, eps), wgu, sgu, bgu), 2, axis=-1)
    expected = (h + product(nn.silu(gate) * up, wd, sd, bd)).astype(mx.float32)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= 4 * _TOLERANCE[dtype] * mx.abs(expected).max().item()
