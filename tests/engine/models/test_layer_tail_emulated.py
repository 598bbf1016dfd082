"""The layer-tail kernel's own source (models.layer_tail_cuda) run on the CPU: its three phases
(output product with the residual, norm and gate/up with the activation, down with the second
residual), their warps taking column sets in turn, and the grid barrier between them, against
MLX's own ops. The blocks run at once here (each lane a thread, as ``cuda_on_cpu`` runs one
block), so the barrier between phases is the kernel's own, across blocks. Each warp sums its
columns' whole K here (the shared memory of warps splitting it would be one for all blocks);
the GPU tests take the split. Skipped without g++."""

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

# The layer tail is off by default (measured slower), so its sweep runs with the long tests.
pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel for the CPU"),
    pytest.mark.long,
]

_TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

# The prelude with a block's warp and block barriers and shuffle slots per thread, so blocks
# can run at once (shared arrays stay one for all blocks: the only ones written, the norm's,
# get the same values from every block); what CUDA gives the grid barrier; MLX's Sigmoid.
_CONCURRENT = (
    PRELUDE.replace("std::barrier<>* warp_barriers[32];", "thread_local std::barrier<>** warp_barriers;")
    .replace("std::barrier<>* block_barrier;", "thread_local std::barrier<>* block_barrier;")
    .replace("float slots[1024];", "thread_local float* slots;")
)
_GRID = r"""
Index gridDim{BLOCKS, 1};
// Every block of the grid at once (each later one starting later): per block its warp
// barriers, block barrier and slots.
template <typename F>
static void run_grid(int warps, F body) {
  std::vector<std::barrier<>*> bars;
  std::vector<std::vector<std::barrier<>*>> warp_bars(BLOCKS);
  std::vector<std::vector<float>> block_slots(BLOCKS, std::vector<float>(1024));
  for (int b = 0; b < BLOCKS; ++b) {
    for (int i = 0; i < warps; ++i) warp_bars[b].push_back(new std::barrier<>(32));
    bars.push_back(new std::barrier<>(warps * 32));
  }
  std::vector<std::thread> threads;
  for (int b = 0; b < BLOCKS; ++b)
    for (int t = 0; t < warps * 32; ++t)
      threads.emplace_back([&, b, t] {
        threadIdx.x = t;
        blockIdx.x = b;
        blockIdx.y = 0;
        warp_barriers = warp_bars[b].data();
        block_barrier = bars[b];
        slots = block_slots[b].data();
        // Later blocks start later, so a barrier that does not wait lets the first read what
        // they have not written yet.
        std::this_thread::sleep_for(std::chrono::milliseconds(300 * b));
        body();
      });
  for (auto& t : threads) t.join();
  for (auto& w : warp_bars) for (auto* bar : w) delete bar;
  for (auto* bar : bars) delete bar;
}
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
  for (int launch = 0; launch < 2; ++launch) {  // twice: the barrier is left ready
    // Each launch's outputs start cleared, as fresh ones would (the second must not read the first's).
    memset(out.data(), 0, out.size() * sizeof(T));
    memset(h.data(), 0, h.size() * sizeof(T));
    memset(a.data(), 0, a.size() * sizeof(T));
    run_grid(WARPS, [&] {
      kernel(attn.data(), x.data(), wo.data(), so.data(), bo.data(), norm.data(), wgu.data(), sgu.data(),
             bgu.data(), wd.data(), sd.data(), bd.data(), barrier.data(), out.data(), h.data(), a.data());
    });
  }
  printf("%u\n", barrier[0]);
  FILE* f = fopen("out.bin", "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fclose(f);
}
"""


def _quantized(key, n: int, k: int, dtype, bits: int, group: int):
    w = (mx.random.normal((n, k), key=key) * k**-0.5).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


@pytest.mark.parametrize(
    "rows, heads_width, hidden, intermediate, bits, group, dtype, blocks, warps",
    [
        (1, 256, 192, 320, 4, 64, mx.float32, 3, 2),
        (1, 128, 256, 384, 8, 32, mx.bfloat16, 2, 3),
        (3, 256, 128, 256, 4, 128, mx.float16, 1, 2),
        (6, 128, 128, 192, 4, 32, mx.bfloat16, 2, 2),
    ],
    ids=str,
)
def test_the_layer_tail_equals_the_products_norm_and_activation_it_joins(
    tmp_path, rows, heads_width, hidden, intermediate, bits, group, dtype, blocks, warps
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
        "constexpr int KSO = 1; constexpr int KSG = 1; constexpr int KSD = 1; "
        f"constexpr int KA = {heads_width}; constexpr int H = {hidden}; constexpr int I = {intermediate}; "
        f"constexpr int EPS = {qmv.float_bits(eps)};"
    )
    program = (
        _CONCURRENT
        + f"constexpr int BLOCKS = {blocks};\n"
        + _GRID
        + qmv.compact(qmv.DEVICE_FUNCTIONS + tail.BARRIER)
        + f"using T = {CPP_TYPE[dtype]};\nconstexpr int ROWS = {rows}, HIDDEN = {hidden}, INTER = {intermediate}, WARPS = {warps};\n"
        + _DRIVER.replace("CONSTANTS", constants).replace("SOURCE", qmv.compact(tail.SOURCE))
    )
    build(tmp_path, program)
    ran = subprocess.run(["./kernel"], cwd=tmp_path, check=True, timeout=120, capture_output=True, text=True)
    assert ran.stdout.split() == ["0"]  # two launches, two crossings each: every flip and count undone
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
