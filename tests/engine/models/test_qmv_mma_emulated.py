"""The tensor-core kernel's source (models.quantized_mma_cuda) run on the CPU: its fragment
layout, the pairing of codes with activations, the groups' scales and biases and the K-splits,
checked where no GPU is.

The kernel body is built as C++ (tests.engine.models.cuda_on_cpu) with its two primitives
replaced: ``mma_16816`` computes the 16 x 8 product from the warp's registers as PTX lays out
m16n8k16's fragments (each lane posts its registers, then reads every lane's), and
``codes_pair`` does what its assembly does (the code under the exponent, the offset taken
away). The outputs must equal ``mx.quantized_matmul`` in float32 to rounding for 1 to 16
rows, every group size, both half types, K-splits of 1 to 8 warps, outputs that are not a
multiple of the 16-column tile, a K that ends inside an iteration and activations that are
not 16-byte aligned. Skipped without g++; the primitives' own assembly is checked on the GPU
(tests/engine/models/test_qmv_mma_cuda.py).
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import quantized_mma_cuda as mma
from engine.models.quantized_matmul_cuda import compact, float_bits
from tests.engine.models.cuda_on_cpu import (
    CPP_TYPE,
    GLU_DRIVER,
    NORM_DRIVER,
    PRELUDE,
    PRODUCT_DRIVER,
    RESIDUAL_DRIVER,
    build,
    normed_product,
    raw_values,
)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel for the CPU")

_PRIMITIVES = r"""
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t both = ((uint64_t)y << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
template <bool BF>
inline float half_value(uint32_t reg, int high) {
  const uint16_t v = high ? reg >> 16 : reg & 0xffff;
  if (BF) {
    bf16 b;
    b.v = v;
    return b;
  }
  _Float16 h;
  memcpy(&h, &v, 2);
  return (float)h;
}
template <bool BF>
inline uint32_t half_bits(float f) {
  if (BF) return bf16(f).v;
  const _Float16 h = (_Float16)f;
  uint16_t v;
  memcpy(&v, &h, 2);
  return v;
}
uint32_t mma_registers[32][32][6];
template <bool BF>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) mma_registers[w][lane][i] = a[i];
  mma_registers[w][lane][4] = b0;
  mma_registers[w][lane][5] = b1;
  warp_barriers[w]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int m = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    float sum = c[i];
    for (int k = 0; k < 16; ++k) {
      // A[m][k]: lane 4 (m % 8) + (k % 8) / 2, register (m >= 8) + 2 (k >= 8), half k % 2;
      // B[k][n]: lane 4 n + (k % 8) / 2, register (k >= 8), half k % 2.
      const float av = half_value<BF>(mma_registers[w][4 * (m & 7) + ((k & 7) >> 1)][(m >= 8) + 2 * (k >= 8)], k & 1);
      const float bv = half_value<BF>(mma_registers[w][4 * n + ((k & 7) >> 1)][4 + (k >= 8)], k & 1);
      sum += av * bv;
    }
    c[i] = sum;
  }
  warp_barriers[w]->arrive_and_wait();
}
template <bool BF>
inline uint32_t codes_pair(uint32_t w) {
  const uint32_t h = (w & 0x000F000Fu) | (BF ? 0x43004300u : 0x64006400u);
  const float offset = BF ? 128.f : 1024.f;
  return half_bits<BF>(half_value<BF>(h, 0) - offset) | half_bits<BF>(half_value<BF>(h, 1) - offset) << 16;
}
"""

_TOLERANCE = {mx.float16: 1e-3, mx.bfloat16: 8e-3}


def _on_cpu(
    tmp_path,
    x,
    wq,
    scales,
    biases,
    group: int,
    splits: int,
    shift: int,
    residual=None,
    glu: bool = False,
    norm: tuple | None = None,
) -> mx.array:
    """The kernel's output on the CPU: the plain product, with ``residual`` added in its
    epilogue, or with ``glu`` the activation of a stacked gate/up weight's product; with
    ``norm`` (weight, eps), of the rows normed in its prologue."""
    rows, k = x.shape
    n = wq.shape[0]
    outputs = n // 2 if glu else n
    constants = (
        f"constexpr bool BF = {str(x.dtype == mx.bfloat16).lower()}; constexpr int R = {rows}; "
        f"constexpr int GS = {group}; constexpr int NW = {mma.WARPS}; constexpr int KS = {splits};"
    )
    driver = GLU_DRIVER if glu else RESIDUAL_DRIVER if residual is not None else PRODUCT_DRIVER
    if norm is not None:
        driver = NORM_DRIVER if glu else NORM_DRIVER.replace("N / 2", "N")
        constants += f" constexpr int KN = {k}; constexpr int EPS = {float_bits(norm[1])};"
        raw_values(norm[0]).tofile(tmp_path / "n.bin")
    source = (
        PRELUDE
        + _PRIMITIVES
        + compact(mma.DEVICE_FUNCTIONS)
        + f"using T = {CPP_TYPE[x.dtype]};\n"
        + driver.replace("CONSTANTS", constants).replace(
            "SOURCE", compact(mma.kernel_source(residual is not None, glu, norm is not None))
        )
    )
    for name, a in zip("xwsb", (x, wq, scales, biases), strict=True):
        (np.array(a) if name == "w" else raw_values(a)).tofile(tmp_path / f"{name}.bin")
    if residual is not None:
        raw_values(residual).tofile(tmp_path / "r.bin")
    build(tmp_path, source)
    columns = 8 if glu else 16
    subprocess.run(
        ["./kernel", *map(str, [rows, k, n, shift, mma.WARPS, splits, columns])], cwd=tmp_path, check=True, timeout=120
    )
    out = mx.array(np.fromfile(tmp_path / "out.bin", dtype=np.uint16).reshape(rows, outputs))
    return out.view(x.dtype)


# rows, inputs, outputs, group, dtype, x shifted by elements, the K-split the matrix takes.
CASES = [
    (1, 512, 37, 64, mx.bfloat16, 0, 2),
    (8, 1024, 16, 32, mx.float16, 0, 4),
    (5, 768, 40, 128, mx.bfloat16, 1, 2),
    (16, 640, 33, 64, mx.bfloat16, 0, 2),
    (11, 2048, 20, 64, mx.float16, 3, 8),
    (9, 256, 17, 32, mx.bfloat16, 0, 1),
]


@pytest.mark.parametrize("rows, inputs, outputs, group, dtype, shift, splits", CASES, ids=str)
def test_the_tensor_core_kernels_source_computes_mlxs_product(
    tmp_path, rows, inputs, outputs, group, dtype, shift, splits
):
    assert mma.k_splits(inputs, outputs, group) == splits
    k1, k2 = mx.random.split(mx.random.key(rows * 7 + inputs + outputs), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=4)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    got = _on_cpu(tmp_path, x, wq, scales, biases, group, splits, shift)
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    expected = mx.quantized_matmul(f32[0], wq, f32[1], f32[2], transpose=True, group_size=group, bits=4)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= _TOLERANCE[dtype] * mx.abs(expected).max().item(), error


def test_a_row_does_not_depend_on_the_rows_beside_it(tmp_path):
    """Rows 0-2 of a 12-row product equal the 3-row product's bit for bit: the same MMAs
    (one tile of 8 rows) and the same sums whatever the other rows hold."""
    k1, k2 = mx.random.split(mx.random.key(5), 2)
    w = (mx.random.normal((24, 512), key=k1) * 512**-0.5).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((12, 512), key=k2).astype(mx.bfloat16)
    splits = mma.k_splits(512, 24, 64)
    many = _on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0)
    few = _on_cpu(tmp_path, x[:3], wq, scales, biases, 64, splits, 0)
    assert mx.array_equal(many[:3], few)


def test_the_layout_splits_k_where_the_columns_are_few():
    assert mma.k_splits(9728, 2560, 64) == 8  # qwen3-4b down: 160 tiles of 16 columns
    assert mma.k_splits(4096, 57344, 64) == 2  # llama3-8b gate+up: 3,584 tiles
    assert mma.k_splits(256, 64, 64) == 1  # one iteration: nothing to split


def _weights_and_rows(rows: int, inputs: int, outputs: int, dtype, seed: int):
    k1, k2 = mx.random.split(mx.random.key(seed), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    return mx.random.normal((rows, inputs), key=k2).astype(dtype), wq, scales, biases


@pytest.mark.parametrize(
    "rows, inputs, outputs, dtype", [(8, 640, 37, mx.bfloat16), (13, 2176, 19, mx.float16)], ids=str
)
def test_the_residual_epilogue_equals_the_product_then_the_add(tmp_path, rows, inputs, outputs, dtype):
    """Bit for bit what the kernel's product rounded to the dtype and a separate add give."""
    x, wq, scales, biases = _weights_and_rows(rows, inputs, outputs, dtype, rows + inputs)
    residual = (4 * mx.random.normal((rows, outputs), key=mx.random.key(3))).astype(dtype)
    splits = mma.k_splits(inputs, outputs, 64)
    got = _on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0, residual=residual)
    plain = _on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0)
    assert mx.array_equal(got, residual + plain)
    assert not mx.array_equal(got, plain)


@pytest.mark.parametrize(
    "rows, inputs, outputs, dtype",
    [(8, 640, 21, mx.bfloat16), (16, 1024, 8, mx.float16), (3, 2048, 12, mx.bfloat16)],
    ids=str,
)
def test_the_glu_epilogue_computes_silu_gate_times_up(tmp_path, rows, inputs, outputs, dtype):
    """Gate rows stacked over up rows: each output is silu(gate) * up of its own two rows, as
    the plain product's halves give it, over K-splits and outputs that are not a
    multiple of the 8 a tile holds."""
    x, wq, scales, biases = _weights_and_rows(rows, inputs, 2 * outputs, dtype, rows * 3 + inputs)
    splits = mma.k_splits(inputs, 2 * outputs, 64)
    got = _on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0, glu=True)
    gate, up = mx.split(_on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0), 2, axis=-1)
    assert got.shape == (rows, outputs)
    # Halves multiply in float here where CUDA rounds each op to the half type, so the CPU
    # run is held to rounding, and tests/engine/models/test_qmv_mma_cuda.py to the bit.
    f32 = [h.astype(mx.float32) for h in (gate, up)]
    expected = nn.silu(f32[0]) * f32[1]
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= 2 * _TOLERANCE[dtype] * mx.abs(expected).max().item(), error


@pytest.mark.parametrize(
    "rows, inputs, outputs, dtype, glu, splits",
    [(1, 2560, 37, mx.bfloat16, True, 8), (3, 1024, 20, mx.float16, False, 4), (6, 512, 17, mx.bfloat16, False, 2)],
    ids=str,
)
def test_the_norm_prologue_computes_the_product_of_the_rms_norm(tmp_path, rows, inputs, outputs, dtype, glu, splits):
    """Each row normed by the block (the row kernel's ``block_norm``) before the product, with
    and without the activation in the epilogue, over K-splits of 2, 4 and 8."""
    n = 2 * outputs if glu else outputs
    assert mma.k_splits(inputs, n, 64) == splits
    keys = mx.random.split(mx.random.key(rows * 7 + inputs + outputs), 3)
    w = (mx.random.normal((n, inputs), key=keys[0]) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = (5 * mx.random.normal((rows, inputs), key=keys[1])).astype(dtype)
    weight = (1 + 0.3 * mx.random.normal((inputs,), key=keys[2])).astype(dtype)
    got = _on_cpu(tmp_path, x, wq, scales, biases, 64, splits, 0, glu=glu, norm=(weight, 1e-6))
    expected = normed_product(x, weight, 1e-6, wq, scales, biases, glu)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= 2 * _TOLERANCE[dtype] * mx.abs(expected).max().item()
    unnormed = normed_product(x, None, 0, wq, scales, biases, glu)
    assert mx.abs(got.astype(mx.float32) - unnormed).max().item() > 10 * error  # the norm ran
