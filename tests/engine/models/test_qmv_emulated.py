"""The CUDA kernels' own source, run on the CPU: their indexing and arithmetic checked where
no GPU is.

The kernel body, its device function and header of ``models.quantized_matmul_cuda`` are compiled as C++ (g++)
beside a few definitions that stand in for CUDA's: each lane a thread, a warp's shuffles
meeting at a barrier of its 32 threads, ``__syncthreads`` at one of the block's, and blocks
run one after another. The outputs must equal ``mx.quantized_matmul`` in float32 to
rounding, over K-splits of 1, 2 and 4 warps, both bit widths, every group size, all three
dtypes, inputs not a multiple of a warp's stride, outputs not a multiple of a block's
columns and activations not 16-byte aligned (the one-by-one loads). The gathered variant
(expert products) must equal ``mx.gather_qmm``, a token's row shared by its experts and a
row per expert. Skipped without g++.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import gathered_matmul_cuda as gathered
from engine.models import quantized_matmul_cuda as qmv
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

_TOLERANCE = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}


def _program(
    driver: str,
    kernel: str,
    dtype,
    bits: int,
    group: int,
    splits: int,
    extra: str,
    loop: str = "",
    columns: int = qmv.COLUMNS,
) -> str:
    """The C++ program: the kernel's device code and ``kernel`` as the driver runs it, with
    the kernel's template constants (``extra``: the variant's own; ``columns`` a warp) and
    activation type, after ``loop`` (``qmv.chunk_loop``'s defines)."""
    constants = (
        f"{extra} constexpr int BITS = {bits}; constexpr int GS = {group}; "
        f"constexpr int CPW = {columns}; constexpr int NW = {qmv.WARPS}; constexpr int KS = {splits};"
    )
    source = PRELUDE + loop + qmv.compact(qmv.DEVICE_FUNCTIONS) + f"using T = {CPP_TYPE[dtype]};\n"
    return source + driver.replace("CONSTANTS", constants).replace("SOURCE", qmv.compact(kernel))


def _run_on_cpu(
    tmp_path, x, wq, scales, biases, group: int, bits: int, shift: int, loop: str = "", columns: int = qmv.COLUMNS
) -> mx.array:
    rows, k = x.shape
    n = wq.shape[0]
    splits = qmv.k_splits(k, n, bits)
    row_constant = f"constexpr int R = {rows};"
    source = _program(PRODUCT_DRIVER, qmv._SOURCE, x.dtype, bits, group, splits, row_constant, loop, columns)
    return _build_and_run(tmp_path, source, (x, wq, scales, biases), [rows, k, n, shift, qmv.WARPS, splits, columns])


def _build_and_run(tmp_path, source: str, arrays, args: list[int], ids=None, outputs=None) -> mx.array:
    """Build ``source``, run it on ``arrays`` (x, w, scales, biases; ``ids`` too where given)
    with ``args``; its output, [outputs' rows, ``outputs`` (N when not given)], in x's dtype."""
    x, wq, scales, _ = arrays
    for name, a in zip("xwsb", arrays, strict=True):
        (np.array(a) if name == "w" else raw_values(a)).tofile(tmp_path / f"{name}.bin")
    if ids is not None:
        np.array(ids).astype(np.uint32).tofile(tmp_path / "i.bin")
    build(tmp_path, source)
    subprocess.run(["./kernel", *map(str, args)], cwd=tmp_path, check=True, timeout=60)
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint16 if x.dtype == mx.bfloat16 else raw_values(x).dtype)
    out = mx.array(raw.reshape(-1, outputs or scales.shape[-2]))
    return out.view(mx.bfloat16) if x.dtype == mx.bfloat16 else out


# rows, inputs, outputs, bits, group, dtype, x shifted by elements; the K-split each takes
# is checked too (1, 2 and 4 warps a column set).
CASES = [
    (1, 640, 37, 4, 64, mx.float32, 0, 1),
    (3, 2176, 19, 8, 32, mx.float32, 0, 4),
    (5, 3200, 16, 4, 128, mx.bfloat16, 0, 2),
    (16, 640, 33, 8, 64, mx.bfloat16, 1, 1),
    (7, 64, 5, 4, 64, mx.float16, 3, 1),
    (2, 4864, 23, 4, 32, mx.float16, 1, 4),
    (1, 640, 37, 2, 64, mx.float32, 0, 1),  # 2-bit words: 64 codes a lane's chunk
    (3, 8192, 19, 2, 128, mx.bfloat16, 1, 4),
    (8, 1280, 33, 2, 64, mx.float16, 2, 1),
    (1, 640, 37, 3, 64, mx.float32, 0, 1),  # 3, 5, 6 bits: 32 codes end to end in 3, 5, 6 words
    (16, 1280, 9, 3, 32, mx.bfloat16, 1, 1),
    (2, 2560, 19, 5, 128, mx.float16, 3, 2),
    (4, 4096, 21, 6, 32, mx.bfloat16, 0, 4),
    (7, 192, 12, 6, 64, mx.float32, 2, 1),
]


@pytest.mark.parametrize("rows, inputs, outputs, bits, group, dtype, shift, splits", CASES, ids=str)
def test_the_kernels_source_computes_mlxs_product(tmp_path, rows, inputs, outputs, bits, group, dtype, shift, splits):
    assert qmv.k_splits(inputs, outputs, bits) == splits
    k1, k2 = mx.random.split(mx.random.key(rows + inputs + outputs), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    got = _run_on_cpu(tmp_path, x, wq, scales, biases, group, bits, shift)
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    expected = mx.quantized_matmul(f32[0], wq, f32[1], f32[2], transpose=True, group_size=group, bits=bits)
    assert got.dtype == dtype
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= _TOLERANCE[dtype] * mx.abs(expected).max().item()


# The product's driver for a float mode: E8M0 scale bytes, no biases.
FLOAT_DRIVER = PRODUCT_DRIVER.replace(
    "const T* scales, const T* biases, T* out) {", "const uint8_t* scales, const T* biases, T* out) {"
).replace("(const T*)sb.data(), (const T*)bb.data(), out.data());", "(const uint8_t*)sb.data(), nullptr, out.data());")


@pytest.mark.parametrize(
    "rows, inputs, outputs, mode, dtype, shift",
    [
        (1, 640, 37, "mxfp4", mx.float32, 0),
        (5, 8192, 19, "mxfp4", mx.bfloat16, 1),
        (16, 1280, 9, "mxfp4", mx.float16, 0),
        (3, 2560, 21, "mxfp8", mx.bfloat16, 0),
        (8, 192, 12, "mxfp8", mx.float32, 2),
        (1, 640, 37, "nvfp4", mx.float32, 0),
        (5, 8192, 19, "nvfp4", mx.bfloat16, 1),
        (16, 1280, 9, "nvfp4", mx.float16, 3),
        (2, 96, 11, "nvfp4", mx.bfloat16, 0),  # three chunks: a lane past the last
    ],
    ids=str,
)
def test_the_float_modes_compute_mlxs_product(tmp_path, rows, inputs, outputs, mode, dtype, shift):
    """E2M1 and E4M3 codes (subnormal ones and signed zeros included, which random normal
    weights give at 32-value groups) with E8M0 scales, or NVFP4's E4M3 scales a group of 16,
    against MLX's product in float32. Rows of weights at scales from 2^-8 to 2^8 put NVFP4's
    scales across their range, subnormal ones and the largest included."""
    bits, group = qmv.FLOAT_MODES[mode]
    k1, k2 = mx.random.split(mx.random.key(rows + inputs + bits), 2)
    w = mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5
    if mode == "nvfp4":
        w = w * 2.0 ** mx.linspace(-8, 8, outputs)[:, None] * (1 + 99 * (mx.arange(inputs) % 48 < 16))
    w = w.astype(dtype)
    wq, scales = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    splits = qmv.k_splits(inputs, outputs, bits)
    row_constant = f"constexpr int R = {rows};"
    source = _program(FLOAT_DRIVER, qmv.kernel_source(mode=mode), dtype, bits, group, splits, row_constant)
    args = [rows, inputs, outputs, shift, qmv.WARPS, splits, qmv.COLUMNS]
    got = _build_and_run(tmp_path, source, (x, wq, scales, scales), args)
    expected = mx.quantized_matmul(
        x.astype(mx.float32), wq, scales, None, transpose=True, group_size=group, bits=bits, mode=mode
    )
    assert got.dtype == dtype
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= _TOLERANCE[dtype] * mx.abs(expected).max().item()


@pytest.mark.long  # build switches that are off by default: the long tests sweep them
@pytest.mark.parametrize("rows, inputs, outputs, splits", [(3, 8320, 19, 4), (1, 24640, 9, 4), (2, 64, 9, 1)], ids=str)
def test_a_prefetched_or_unrolled_walk_or_wider_warps_give_the_same_bits(
    monkeypatch, tmp_path, rows, inputs, outputs, splits
):
    """Lanes of 2-3 and 6-7 chunks, and lanes with none (64 inputs are two chunks): the
    prefetch's first, middle and last chunks, and a walk the unrolled loop does not divide.
    Warps of 8 columns split K as warps of 4 do, so they sum in the same order too (a last
    warp with columns past the outputs: 19 and 9 are not multiples of 8)."""
    assert qmv.k_splits(inputs, outputs, 4) == splits
    k1, k2 = mx.random.split(mx.random.key(rows + inputs), 2)
    wq, scales, biases = mx.quantize(mx.random.normal((outputs, inputs), key=k1).astype(mx.bfloat16), bits=4)
    x = mx.random.normal((rows, inputs), key=k2).astype(mx.bfloat16)
    plain = _run_on_cpu(tmp_path, x, wq, scales, biases, 64, 4, 1)
    for env, value in ((qmv.PREFETCH_ENV, "1"), (qmv.UNROLL_ENV, "3")):
        monkeypatch.setenv(env, value)
        loop = qmv.chunk_loop()
        assert loop
        assert mx.array_equal(_run_on_cpu(tmp_path, x, wq, scales, biases, 64, 4, 1, loop), plain), env
        monkeypatch.delenv(env)
    monkeypatch.delenv(qmv.COLUMNS_ENV, raising=False)  # 8 columns: the default for 1-2 rows
    assert qmv.columns(1) == 8 and qmv.columns(qmv.WIDE_ROWS + 1) == qmv.COLUMNS
    wide = _run_on_cpu(tmp_path, x, wq, scales, biases, 64, 4, 1, columns=8)
    assert mx.array_equal(wide, plain)


@pytest.mark.parametrize(
    "rows, inputs, outputs, dtype", [(1, 640, 37, mx.bfloat16), (3, 2176, 19, mx.float16)], ids=str
)
def test_the_residual_epilogue_equals_the_product_then_the_add(tmp_path, rows, inputs, outputs, dtype):
    """Bit for bit what the product rounded to the dtype and a separate add give."""
    k1, k2, k3 = mx.random.split(mx.random.key(rows * 5 + inputs), 3)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    residual = (4 * mx.random.normal((rows, outputs), key=k3)).astype(dtype)
    raw_values(residual).tofile(tmp_path / "r.bin")
    splits = qmv.k_splits(inputs, outputs, 4)
    source = _program(RESIDUAL_DRIVER, qmv._RESIDUAL_SOURCE, dtype, 4, 64, splits, f"constexpr int R = {rows};")
    got = _build_and_run(
        tmp_path, source, (x, wq, scales, biases), [rows, inputs, outputs, 0, qmv.WARPS, splits, qmv.COLUMNS]
    )
    plain = _run_on_cpu(tmp_path, x, wq, scales, biases, 64, 4, 0)
    assert mx.array_equal(got, residual + plain)
    assert not mx.array_equal(got, plain)


@pytest.mark.parametrize(
    "rows, inputs, outputs, bits, group, dtype, splits",
    [
        (1, 640, 37, 4, 64, mx.float32, 1),
        (3, 2176, 10, 8, 32, mx.bfloat16, 4),
        (5, 3200, 8, 4, 128, mx.float16, 2),
        (12, 640, 33, 4, 64, mx.bfloat16, 1),
    ],
    ids=str,
)
def test_the_glu_epilogue_computes_silu_gate_times_up(tmp_path, rows, inputs, outputs, bits, group, dtype, splits):
    """Gate rows stacked over up rows: each output is silu(gate) * up of its own two rows,
    over K-splits of 1, 2 and 4 warps and outputs not a multiple of a block's."""
    assert qmv.k_splits(inputs, 2 * outputs, bits) == splits
    k1, k2 = mx.random.split(mx.random.key(rows * 3 + inputs + outputs), 2)
    w = (mx.random.normal((2 * outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    source = _program(GLU_DRIVER, qmv._GLU_SOURCE, dtype, bits, group, splits, f"constexpr int R = {rows};")
    args = [rows, inputs, 2 * outputs, 0, qmv.WARPS, splits, qmv.COLUMNS // 2]
    got = _build_and_run(tmp_path, source, (x, wq, scales, biases), args, outputs=outputs)
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    product = mx.quantized_matmul(f32[0], wq, f32[1], f32[2], transpose=True, group_size=group, bits=bits)
    gate, up = mx.split(product, 2, axis=-1)
    expected = nn.silu(gate) * up
    assert got.dtype == dtype and got.shape == (rows, outputs)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= 2 * _TOLERANCE[dtype] * mx.abs(expected).max().item()


# The product of the rows' RMSNorm (``matmul``'s ``norm``), with or without the activation.
@pytest.mark.parametrize(
    "rows, inputs, outputs, dtype, glu, splits",
    [
        (1, 640, 37, mx.float32, False, 1),
        (1, 8448, 19, mx.bfloat16, False, 4),
        (3, 2176, 13, mx.float16, False, 2),
        (2, 640, 21, mx.float16, True, 1),
        (6, 2560, 11, mx.bfloat16, True, 2),
    ],
    ids=str,
)
def test_the_norm_prologue_computes_the_product_of_the_rms_norm(
    monkeypatch, tmp_path, rows, inputs, outputs, dtype, glu, splits
):
    """Each row normed by the block (its mean square, the epsilon, the norm's weight) before the
    product, with and without the activation in the epilogue, over K-splits of 1, 2 and 4; the
    same bits with each lane's first chunk loaded before the norm (``MLX_DESK_QMV_EARLY_LOAD``)."""
    n = 2 * outputs if glu else outputs
    assert qmv.k_splits(inputs, n, 4) == splits and qmv.norm_fits(rows, inputs, dtype)
    keys = mx.random.split(mx.random.key(rows * 11 + inputs + outputs), 3)
    w = (mx.random.normal((n, inputs), key=keys[0]) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = (5 * mx.random.normal((rows, inputs), key=keys[1])).astype(dtype)
    weight = (1 + 0.3 * mx.random.normal((inputs,), key=keys[2])).astype(dtype)
    eps = 1e-6
    raw_values(weight).tofile(tmp_path / "n.bin")
    constants = f"constexpr int R = {rows}; constexpr int KN = {inputs}; constexpr int EPS = {qmv.float_bits(eps)};"
    driver = NORM_DRIVER if glu else NORM_DRIVER.replace("N / 2", "N")
    source = _program(driver, qmv.kernel_source(glu=glu, norm=True), dtype, 4, 64, splits, constants)
    args = [rows, inputs, n, 0, qmv.WARPS, splits, qmv.COLUMNS // 2 if glu else qmv.COLUMNS]
    got = _build_and_run(tmp_path, source, (x, wq, scales, biases), args, outputs=outputs)
    expected = normed_product(x, weight, eps, wq, scales, biases, glu)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= 2 * _TOLERANCE[dtype] * mx.abs(expected).max().item()
    monkeypatch.setenv(qmv.EARLY_ENV, "1")
    early = _program(driver, qmv.kernel_source(glu=glu, norm=True), dtype, 4, 64, splits, constants, qmv.early_load())
    assert mx.array_equal(_build_and_run(tmp_path, early, (x, wq, scales, biases), args, outputs=outputs), got)


# The gathered variant (expert products): blocks run per (token, expert) pair, blockIdx.y.
_GATHER_DRIVER = r"""
static void kernel(const T* x, const Shape x_shape, const uint32_t* w, const Shape w_shape,
                   const T* scales, const T* biases, const uint32_t* ids, T* out) {
  CONSTANTS
  SOURCE
}
int main(int argc, char** argv) {
  const int pairs = atoi(argv[1]), K = atoi(argv[2]), N = atoi(argv[3]), E = atoi(argv[4]);
  const int warps = atoi(argv[5]), splits = atoi(argv[6]), columns = atoi(argv[7]);
  auto xb = slurp("x.bin"), wb = slurp("w.bin"), sb = slurp("s.bin"), bb = slurp("b.bin"), ib = slurp("i.bin");
  std::vector<T> xs(xb.size() / sizeof(T));
  memcpy(xs.data(), xb.data(), xb.size());
  std::vector<uint32_t> ws(wb.size() / 4), is(ib.size() / 4);
  memcpy(ws.data(), wb.data(), wb.size());
  memcpy(is.data(), ib.data(), ib.size());
  std::vector<T> out((size_t)pairs * N);
  Shape xsh{}, wsh{};
  xsh[0] = (int)(xs.size() / K); xsh[1] = K; wsh[0] = E; wsh[1] = N; wsh[2] = (int)(ws.size() / E / N);
  const int per_block = warps / splits * columns, blocks = (N + per_block - 1) / per_block;
  for (int p = 0; p < pairs; ++p)
    for (int b = 0; b < blocks; ++b)
      run_block(warps, b, p, [&] {
        kernel(xs.data(), xsh, ws.data(), wsh, (const T*)sb.data(), (const T*)bb.data(), is.data(), out.data());
      });
  FILE* f = fopen("out.bin", "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fclose(f);
}
"""


@pytest.mark.parametrize(
    "tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype",
    [
        (1, 3, 5, 640, 37, True, 4, 64, mx.float32),  # a token's row for its 3 experts (gate, up)
        (2, 2, 4, 256, 19, False, 8, 32, mx.bfloat16),  # a row per pair (down)
        (1, 2, 3, 384, 11, True, 3, 64, mx.float16),  # an expert's words at 3 bits: K / 32 * 3
    ],
    ids=str,
)
def test_the_gathered_kernels_source_computes_mlxs_gather_qmm(
    tmp_path, tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype
):
    keys = mx.random.split(mx.random.key(tokens * 7 + inputs + outputs), 3)
    w = (mx.random.normal((experts, outputs, inputs), key=keys[0]) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    ids = mx.argsort(mx.random.uniform(shape=(tokens, experts), key=keys[1]), axis=-1)[:, :k].astype(mx.uint32)
    ids = ids.reshape(tokens, 1, k) if shared_row else ids
    rows = (tokens, 1, 1, 1, inputs) if shared_row else (tokens, k, 1, inputs)
    x = mx.random.normal(rows, key=keys[2]).astype(dtype)
    shares = gathered.gather_shares(x.shape[:-2], ids.shape)
    splits = qmv.k_splits(inputs, outputs, bits)
    source = _program(
        _GATHER_DRIVER, gathered._GATHER_SOURCE, dtype, bits, group, splits, f"constexpr int XS = {shares};"
    )
    args = [ids.size, inputs, outputs, experts, qmv.WARPS, splits, qmv.COLUMNS]
    got = _build_and_run(tmp_path, source, (x, wq, scales, biases), args, ids=ids.reshape(-1))
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    expected = mx.gather_qmm(
        f32[0], wq, f32[1], f32[2], rhs_indices=ids, transpose=True, group_size=group, bits=bits
    ).reshape(-1, outputs)
    error = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert error <= _TOLERANCE[dtype] * mx.abs(expected).max().item()


# The unpacking of codes alone (``word_codes``), over every code position of 4- and 8-bit
# words: a spread of words (a fixed stride), then every word whose codes are all equal.
_CODES_CHECK = r"""
int main() {
  long wrong = 0, checked = 0;
  for (uint64_t w = 0; w < (1ull << 32); w += 65521 + 4099) {
    float four[8], eight[4];
    word_codes<4>((uint32_t)w, four);
    word_codes<8>((uint32_t)w, eight);
    for (int i = 0; i < 8; ++i) wrong += four[i] != (float)((w >> (4 * i)) & 15u);
    for (int i = 0; i < 4; ++i) wrong += eight[i] != (float)((w >> (8 * i)) & 255u);
    checked += 12;
  }
  for (uint32_t c = 0; c < 256; ++c) {
    float four[8], eight[4];
    word_codes<4>((c & 15u) * 0x11111111u, four);
    word_codes<8>(c * 0x01010101u, eight);
    for (int i = 0; i < 8; ++i) wrong += four[i] != (float)(c & 15u);
    for (int i = 0; i < 4; ++i) wrong += eight[i] != (float)c;
    checked += 12;
  }
  printf("%ld %ld\n", checked, wrong);
  return wrong != 0;
}
"""


def test_every_code_position_of_4_and_8_bit_words_unpacks_exactly(tmp_path):
    build(tmp_path, PRELUDE + qmv.compact(qmv.DEVICE_FUNCTIONS) + _CODES_CHECK)
    run = subprocess.run(["./kernel"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    checked, wrong = map(int, run.stdout.split())
    assert checked > 500_000 and wrong == 0 and run.returncode == 0


def test_the_source_mlx_receives_keeps_the_code_and_drops_the_comments():
    text = "  // why\n  int a = 1;  // trailing\n\n#pragma unroll\n  for (;;) {}\n"
    assert qmv.compact(text) == "int a = 1;\n#pragma unroll\nfor (;;) {}\n"
    compacted = qmv.compact(qmv.DEVICE_FUNCTIONS)
    assert "//" not in compacted and "rows_product" in compacted and "word_codes" in compacted
    assert len(compacted) < 0.75 * len(qmv.DEVICE_FUNCTIONS)


# The heads kernel (models.head_norm_rope_cuda): a warp per (token, head) of q, k and v; keys
# and values stacked in one output [2, B, NKV, L, D].
_HEAD_NORM_DRIVER = r"""
static Index blockDim{WARPS * 32, 1};
using std::cos;
using std::exp2;
using std::sin;
static void kernel(const T* x, WEIGHTS const int32_t* offset, T* q, T* kv) {
  SOURCE
}
static void write(const char* name, const std::vector<T>& a) {
  FILE* f = fopen(name, "wb");
  fwrite(a.data(), sizeof(T), a.size(), f);
  fclose(f);
}
int main() {
  auto xb = slurp("x.bin"), qb = slurp("qw.bin"), kb = slurp("kw.bin"), ob = slurp("off.bin");
  std::vector<T> q((size_t)B * NQ * L * D), kv((size_t)2 * B * NKV * L * D);
  const int items = B * L * (NQ + 2 * NKV), blocks = (items + WARPS - 1) / WARPS;
  for (int b = 0; b < blocks; ++b)
    run_block(WARPS, b, 0, [&] {
      kernel((const T*)xb.data(), ARGUMENTS (const int32_t*)ob.data(), q.data(), kv.data());
    });
  write("q.bin", q);
  write("kv.bin", kv);
}
"""


def _driver(normed: bool) -> str:
    weights, arguments = ("const T* q_weight, const T* k_weight,", "(const T*)qb.data(), (const T*)kb.data(),")
    return _HEAD_NORM_DRIVER.replace("WEIGHTS", weights if normed else "").replace(
        "ARGUMENTS", arguments if normed else ""
    )


@pytest.mark.parametrize(
    "b, n, nq, nkv, d, dtype, offsets, normed",
    [
        (1, 1, 4, 2, 64, mx.bfloat16, [517], True),
        (1, 3, 2, 1, 128, mx.float32, [1_999], True),
        (3, 1, 2, 2, 64, mx.float16, [3, 700, 0], True),
        (1, 1, 4, 2, 128, mx.bfloat16, [517], False),
        (2, 2, 2, 1, 64, mx.float32, [40, 9], False),
    ],
    ids=str,
)
def test_the_heads_kernels_source_computes_mlxs_norm_then_rope(tmp_path, b, n, nq, nkv, d, dtype, offsets, normed):
    from engine.models import head_norm_rope_cuda as fused

    eps, base, scale = 1e-6, 1_000_000.0, 1.0
    keys = mx.random.split(mx.random.key(b * 7 + n + d), 3)
    x = (3 * mx.random.normal((b, n, nq + 2 * nkv, d), key=keys[0])).astype(dtype)
    q_weight, k_weight = ((1 + 0.3 * mx.random.normal((d,), key=key)).astype(dtype) for key in keys[1:])
    for name, a in (("x", x), ("qw", q_weight), ("kw", k_weight)):
        raw_values(a).tofile(tmp_path / f"{name}.bin")
    np.array(offsets, np.int32).tofile(tmp_path / "off.bin")
    template = f"B = {b}; constexpr int L = {n}; constexpr int NQ = {nq}; constexpr int NKV = {nkv};"
    constants = (
        f"using T = {CPP_TYPE[dtype]};\nconstexpr int {template} constexpr int D = {d};\n"
        f"constexpr int OFFSETS = {len(offsets)}; constexpr int WARPS = {fused.WARPS};\n"
        + fused.constants(eps, scale, fused.log2_float32(base))
    )
    build(tmp_path, PRELUDE + constants + _driver(normed).replace("SOURCE", fused.compact(fused.source(normed))))
    subprocess.run(["./kernel"], cwd=tmp_path, check=True, timeout=60)

    def read(name: str) -> mx.array:
        raw = np.fromfile(tmp_path / name, dtype=raw_values(x).dtype)
        return mx.array(raw).view(dtype) if dtype == mx.bfloat16 else mx.array(raw)

    outputs = {"q": read("q.bin").reshape(b, nq, n, d)}
    outputs["k"], outputs["v"] = read("kv.bin").reshape(2, b, nkv, n, d)
    offset = mx.array(offsets if len(offsets) > 1 else offsets[0], mx.int32)
    q, k, v = mx.split(x, [nq, nq + nkv], axis=2)
    # Values move to attention's layout untouched, behind the keys.
    assert mx.array_equal(outputs["v"], v.transpose(0, 2, 1, 3))
    for name, heads, weight in (("q", q, q_weight), ("k", k, k_weight)):
        normed_heads = mx.fast.rms_norm(heads, weight, eps) if normed else heads
        rotated = normed_heads.transpose(0, 2, 1, 3)
        expected = mx.fast.rope(rotated, d, traditional=False, base=base, scale=scale, offset=offset)
        size = mx.abs(expected.astype(mx.float32)).max().item()
        apart = mx.abs(outputs[name].astype(mx.float32) - expected.astype(mx.float32)).max().item()
        # One rounding of the dtype at the output's largest magnitude. In float32 the angle's
        # own rounding shows: MLX's CPU rope and the host's exp2 may part by an ulp of a
        # frequency, about 1e-4 radians at position 2,000.
        assert apart <= {mx.float32: 1e-4, mx.float16: 2**-10, mx.bfloat16: 2**-7}[dtype] * size, apart
        # Bit for bit is asked of the kernel against MLX's CUDA calls (test_head_norm_rope_cuda):
        # MLX's CPU calls round elsewhere (78-83% of these values equal the CUDA kernel's).
