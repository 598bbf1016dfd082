"""The decode kernels' source (the small-row products, plain, gathered and on tensor cores, the
heads' norm and RoPE, and attention over a full-precision or a quantized cache) built by NVIDIA's compiler for a Hopper GPU, where one is installed: what
MLX's runtime compiler would refuse is caught off the GPU, and so are register spills, which
would turn a step's weight read into local-memory traffic.

Each body is wrapped the way ``mx.fast.cuda_kernel`` wraps it (tests.engine.models.nvcc_build).
Skipped without nvcc.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest

from engine.models import decode_attention_cuda as dense_attention
from engine.models import gathered_matmul_cuda as gathered
from engine.models import head_norm_rope_cuda as heads
from engine.models import l2_ahead_cuda as l2_ahead
from engine.models import quantized_attention_cuda as quantized_attention
from engine.models import quantized_matmul_cuda as qmv
from engine.models import quantized_mma_cuda as tensor_cores
from tests.engine.models.nvcc_build import (
    PARTS,
    PASSES,
    SIGMOID,
    build,
    dense_partial,
    product,
    quantized_partial,
    wrapped,
)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build for the GPU")

LOOPS = {
    "default": {},
    "unrolled": {qmv.UNROLL_ENV: "2"},
    "prefetched": {qmv.PREFETCH_ENV: "1"},
    "one op a code": {qmv.ONE_OP_ENV: "1"},
    "two ops a code": {qmv.ONE_OP_ENV: "0"},
    "first chunk before the norm": {qmv.EARLY_ENV: "1"},
}


# The default build (its columns and switches for the rows) with every test run; the switches'
# walks with the long tests.
@pytest.mark.parametrize("loop", [pytest.param(k, marks=() if k == "default" else pytest.mark.long) for k in LOOPS])
@pytest.mark.parametrize(
    "rows, splits, residual, glu, norm",
    [(1, 1, False, True, True), (1, 4, True, False, False), (8, 1, False, True, False)],
    ids=str,
)
def test_every_walk_of_the_product_builds_without_spilling(
    monkeypatch, tmp_path, loop, rows, splits, residual, glu, norm
):
    monkeypatch.delenv(qmv.UNROLL_ENV, raising=False)
    monkeypatch.delenv(qmv.PREFETCH_ENV, raising=False)
    monkeypatch.delenv(qmv.ONE_OP_ENV, raising=False)
    monkeypatch.delenv(qmv.EARLY_ENV, raising=False)
    monkeypatch.delenv(qmv.COLUMNS_ENV, raising=False)
    for name, value in LOOPS[loop].items():
        monkeypatch.setenv(name, value)
    source = product(rows, splits, residual, glu, norm, qmv.build_switches(rows), qmv.columns(rows))
    registers, spilled = build(tmp_path, source)
    assert spilled == 0
    assert registers <= 255


@pytest.mark.parametrize("loop", ["default", "two ops a code"])
def test_wider_warps_build_without_spilling_up_to_their_rows(monkeypatch, tmp_path, loop):
    """8 columns a warp (``MLX_DESK_QMV_COLUMNS``) at the most rows they take, the gate/up
    product with its norm (the variant with the most sums and inputs)."""
    monkeypatch.delenv(qmv.ONE_OP_ENV, raising=False)
    monkeypatch.delenv(qmv.COLUMNS_ENV, raising=False)
    for name, value in LOOPS[loop].items():
        monkeypatch.setenv(name, value)
    source = product(qmv.WIDE_ROWS, 1, False, True, True, qmv.build_switches(qmv.WIDE_ROWS), columns=8)
    registers, spilled = build(tmp_path, source)
    assert spilled == 0
    assert registers <= 255


@pytest.mark.parametrize(
    "bits, rows", [(2, 1), (2, qmv.ROW_LIMITS[2]), (3, 1), (3, qmv.MAX_ROWS), (5, qmv.ROW_LIMITS[5]), (6, qmv.MAX_ROWS)]
)
def test_other_widths_build_without_spilling(tmp_path, bits, rows):
    """2 bits (16 codes a word) and 3, 5, 6 (codes across words): the gate/up product (with its
    norm at one row), at one row and at the most rows each takes."""
    registers, spilled = build(tmp_path, product(rows, 1, False, True, rows == 1, "", bits=bits))
    assert spilled == 0
    assert registers <= 255


@pytest.mark.parametrize("mode", list(qmv.FLOAT_MODES))
@pytest.mark.parametrize("rows", [1, qmv.MAX_ROWS])
def test_the_float_modes_build_without_spilling(tmp_path, mode, rows):
    """Scale bytes and no biases: the plain product at one row and at the most rows."""
    registers, spilled = build(tmp_path, product(rows, 1, False, False, False, "", mode=mode))
    assert spilled == 0
    assert registers <= 255


def test_a_macro_in_an_unroll_pragma_is_refused_as_the_runtime_compiler_refuses_it(tmp_path):
    """The check can fail: ``#pragma unroll`` does not expand macros, so a count given as one
    does not build (the unrolled walk's count is a constant for that reason)."""
    loop = "#define CHUNK_UNROLL\n#define CHUNK_UNROLL_COUNT 2\n"
    with pytest.raises(AssertionError, match="CHUNK_UNROLL_COUNT"):
        build(tmp_path, product(1, 1, False, False, False, loop))


@pytest.mark.parametrize("blocks", [8, 10])
def test_launch_bounds_reach_the_kernel_through_its_header(monkeypatch, tmp_path, blocks):
    """MLX writes the kernel's ``__global__`` line itself: bounds of N 128-thread blocks a
    multiprocessor must hold the one-row product to 65,536 / (N x 128) registers a thread,
    which without them it exceeds."""
    monkeypatch.setenv(qmv.BOUNDS_ENV, str(blocks))
    registers, _ = build(tmp_path, product(1, 1, False, False, False, qmv.bounds()))
    assert registers <= 65536 // (blocks * 128)
    monkeypatch.delenv(qmv.BOUNDS_ENV)
    assert qmv.bounds() == ""
    assert build(tmp_path, product(1, 1, False, False, False, qmv.bounds()))[0] > 65536 // (blocks * 128)


@pytest.mark.parametrize("heads, kv_heads, queries, keys, dims", PASSES, ids=str)
def test_attention_over_a_full_precision_cache_builds_without_spilling(tmp_path, heads, kv_heads, queries, keys, dims):
    assert build(tmp_path, dense_partial(heads, kv_heads, queries, keys, dims))[1] == 0
    constants = [("InT", mx.bfloat16), ("D", dims), ("L", queries), ("REP", heads // kv_heads), ("NKV", kv_heads)]
    merge = wrapped(PARTS, {"out": "InT"}, constants, dense_attention.MERGE_HEADER, dense_attention._MERGE)
    assert build(tmp_path, merge)[1] == 0


@pytest.mark.parametrize(
    "heads, kv_heads, queries, keys, dims, bits", [(*PASSES[0], 8), (*PASSES[1], 4), (*PASSES[2], 4)], ids=str
)
def test_attention_over_a_quantized_cache_and_its_merge_build_without_spilling(
    tmp_path, heads, kv_heads, queries, keys, dims, bits
):
    assert build(tmp_path, quantized_partial(heads, kv_heads, queries, keys, dims, bits))[1] == 0
    constants = [("InT", mx.bfloat16), ("D", dims), ("L", queries), ("REP", heads // kv_heads), ("NKV", kv_heads)]
    merge = wrapped(PARTS, {"out": "InT"}, constants, quantized_attention._HEADER, quantized_attention._MERGE)
    assert build(tmp_path, merge)[1] == 0


@pytest.mark.parametrize("switches", ["", "#define ONE_OP_CODES\n"], ids=["plain", "one op a code"])
@pytest.mark.parametrize(
    "rows, residual, glu, norm", [(1, False, True, True), (8, True, False, False), (16, False, False, False)], ids=str
)
def test_the_tensor_core_kernel_builds_without_spilling(tmp_path, switches, rows, residual, glu, norm):
    names = ["x", "w", "scales", "biases"] + ["residual"] * residual + ["norm"] * norm
    constants = [("T", mx.bfloat16), ("BF", True), ("R", rows), ("GS", 64), ("NW", tensor_cores.WARPS), ("KS", 2)]
    constants += [("KN", 2560), ("EPS", qmv.float_bits(1e-6))]
    source = wrapped(
        {n: "uint32_t" if n == "w" else "T" for n in names},
        {"out": "T"},
        constants,
        switches + SIGMOID + qmv.compact(tensor_cores.PRIMITIVES + tensor_cores.DEVICE_FUNCTIONS),
        qmv.compact(tensor_cores.kernel_source(residual, glu, norm)),
    )
    assert build(tmp_path, source)[1] == 0


@pytest.mark.parametrize("switches", ["", "#define ONE_OP_CODES\n"], ids=["plain", "one op a code"])
def test_the_gathered_expert_product_builds_without_spilling(tmp_path, switches):
    """qwen3.5-35b-a3b's gate/up experts (2048 -> 512), a token's row shared by its 8 experts."""
    constants = [("T", mx.bfloat16), ("BITS", 4), ("GS", 64), ("CPW", qmv.COLUMNS), ("NW", qmv.WARPS)]
    constants += [("KS", qmv.k_splits(2048, 512, 4)), ("XS", 8)]
    source = wrapped(
        {"x": "T", "w": "uint32_t", "scales": "T", "biases": "T", "ids": "uint32_t"},
        {"out": "T"},
        constants,
        switches + qmv.compact(qmv.DEVICE_FUNCTIONS),
        qmv.compact(gathered._GATHER_SOURCE),
    )
    assert build(tmp_path, source)[1] == 0


@pytest.mark.parametrize("ahead", [0, 6])
@pytest.mark.parametrize("normed", [True, False])
def test_the_head_norm_and_rope_kernel_builds_without_spilling(tmp_path, normed, ahead):
    """qwen3-4b's step (32 query and 8 KV heads of 128), a position for each of 2 rows; with
    the next products' weights asked into L2 in its launch (``ahead`` arrays) or without."""
    weights = {"q_weight": "T", "k_weight": "T"} if normed else {}
    arrays = [mx.zeros((1 << 20,), mx.uint32)] * ahead
    constants = [("T", mx.bfloat16), ("B", 2), ("L", 1), ("NQ", 32), ("NKV", 8), ("D", 128), ("OFFSETS", 2)]
    constants += l2_ahead.constants(arrays) if ahead else []
    body = heads.kernel_source(normed, 1e-6, 1.0, heads.log2_float32(1e6), ahead)
    inputs = {"x": "T", **weights, "offset": "int32_t", **{f"a{i}": "uint32_t" for i in range(ahead)}}
    source = wrapped(inputs, {"q": "T", "kv": "T"}, constants, "", body)
    assert build(tmp_path, source)[1] == 0


@pytest.mark.parametrize("count", [1, 6, l2_ahead.MAX_ARRAYS])
def test_the_l2_prefetch_kernel_builds(tmp_path, count):
    """Hopper's bulk prefetch to L2 as the kernel writes it (sm_90), for one to nine arrays."""
    inputs = {"q": "T", **{f"a{i}": "uint32_t" for i in range(count)}}
    sizes = [(f"S{i}", 5_000_000 + 16 * i if i < count else 0) for i in range(l2_ahead.MAX_ARRAYS)]
    constants = [("T", mx.bfloat16), ("PIECE", l2_ahead.PIECE), ("QN", 4096), *sizes]
    assert build(tmp_path, wrapped(inputs, {"out": "T"}, constants, "", l2_ahead.source(count)))[1] == 0
