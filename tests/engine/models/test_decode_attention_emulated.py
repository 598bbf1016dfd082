"""The split decode attention's CUDA source (models.decode_attention_cuda: a warp a slice,
then its own merge), and the quantized cache's whose header it shares
(models.quantized_attention_cuda), built for the CPU with g++ (``cuda_on_cpu``: a thread per
lane, blocks one after another) and run over a cache read in place from a larger buffer,
must equal MLX's own attention (over the dequantized cache for the quantized one): one
query, a causal verify pass, grouped heads, float32 and bfloat16, slices walked in one pass
or several, empty or past some rows' positions. The GPU tests check the same on CUDA."""

from __future__ import annotations

import subprocess
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from engine.models import decode_attention_cuda as decode
from engine.models import quantized_attention_cuda as shared
from tests.engine.models.cuda_on_cpu import CPP_TYPE, PRELUDE, build, raw_values

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "g++"], capture_output=True).returncode != 0, reason="needs g++"
)

DRIVER = r"""
#define __global__
using Strides = std::array<int64_t, 8>;
Index gridDim;
HEADERS
static void partial(PARTIAL_PARAMETERS, float* part_acc, float* part_max, float* part_sum) {
  using InT = T;
  CONSTANTS
  PARTIAL_BODY
}
static void merge(const float* part_acc, const Shape part_max_shape, const float* part_max, const float* part_sum,
                  T* out) {
  using InT = T;
  CONSTANTS
  MERGE_BODY
}
int main(int argc, char** argv) {
  const int b = atoi(argv[1]), n_kv = atoi(argv[2]), n_keys = atoi(argv[3]), capacity = atoi(argv[4]);
  const int slices = atoi(argv[5]), blocks = atoi(argv[6]), rows = R_ROWS;
  const float scale = atof(argv[7]);
  const int grid_y = atoi(argv[8]);  // slices, or slices over the warps where each warp has its own
  auto qb = slurp("q.bin"), kb = slurp("k.bin"), vb = slurp("v.bin");
  auto ksb = slurp("ks.bin"), kbb = slurp("kb.bin"), vsb = slurp("vs.bin"), vbb = slurp("vb.bin");
  Shape ks{};
  ks[0] = b; ks[1] = n_kv; ks[2] = n_keys; ks[3] = D_DIM;
  Shape whole = ks;  // the whole buffer's shape, for the kernel that takes the count as an input
  whole[2] = capacity;
  // Row strides of the buffers (values, or code words, and scales), read in place.
  auto strides = [&](int64_t row) { Strides st{}; st[0] = n_kv * capacity * row; st[1] = capacity * row; st[2] = row; st[3] = 1; return st; };
  const Strides st = strides(VALUE_STRIDE), sst = strides(SCALE_STRIDE);
  std::vector<float> acc((size_t)b * n_kv * slices * rows * D_DIM), mx_((size_t)b * n_kv * slices * rows),
      sm((size_t)b * n_kv * slices * rows);
  gridDim.y = grid_y;
  for (int z = 0; z < blocks; ++z)
    for (int y = 0; y < grid_y; ++y)
      run_block(NW_WARPS, 0, y, z, [&] {
        partial(PARTIAL_ARGUMENTS, acc.data(), mx_.data(), sm.data());
      });
  Shape ps{};
  ps[0] = b * n_kv; ps[1] = slices; ps[2] = rows;
  std::vector<T> out((size_t)b * n_kv * rows * D_DIM);
  for (int z = 0; z < b * n_kv; ++z)
    for (int r = 0; r < rows; ++r)
      run_block(MERGE_WARPS, 0, r, z, [&] { merge(acc.data(), ps, mx_.data(), sm.data(), out.data()); });
  FILE* f = fopen("out.bin", "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fclose(f);
}
"""


class Kernel(NamedTuple):
    """A partial kernel as the driver calls it, and the merge that follows it."""

    parameters: str
    arguments: str
    body: str
    slices_a_block: int  # along the grid's y: a warp each, or the whole block on one
    merge: str
    merge_warps: int  # 0: a warp per 32 dimensions


_DENSE_MERGE = (decode._MERGE, decode.MERGE_THREADS // 32)
DENSE = Kernel(
    "const T* q, const float* sc, const T* k, const Shape k_shape, const Strides k_strides, const T* v, "
    "const Strides v_strides",
    "(const T*)qb.data(), &scale, (const T*)kb.data(), ks, st, (const T*)vb.data(), st",
    decode.PARTIAL_SOURCE,
    decode.WARPS,
    *_DENSE_MERGE,
)
# The kernel over a whole buffer, its key count an input (``nk``) and its keys' shape the
# capacity's.
COUNTED = Kernel(
    "const T* q, const float* sc, const int* nk, const T* k, const Shape k_shape, const Strides k_strides, const T* v, "
    "const Strides v_strides",
    "(const T*)qb.data(), &scale, &n_keys, (const T*)kb.data(), whole, st, (const T*)vb.data(), st",
    decode.COUNTED_SOURCE,
    decode.WARPS,
    *_DENSE_MERGE,
)
QUANTIZED = Kernel(
    "const T* q, const float* sc, const uint32_t* kw, const Shape kw_shape, const Strides kw_strides, const T* ks, "
    "const Strides ks_strides, const T* kb, const uint32_t* vw, const Strides vw_strides, const T* vs, "
    "const Strides vs_strides, const T* vb",
    "(const T*)qb.data(), &scale, (const uint32_t*)kb.data(), ks, st, (const T*)ksb.data(), sst, (const T*)kbb.data(), "
    "(const uint32_t*)vb.data(), st, (const T*)vsb.data(), sst, (const T*)vbb.data()",
    shared.PARTIAL_SOURCE,
    1,
    shared._MERGE,
    0,
)


def _source(template, rows: int, n_kv: int, d: int, kernel=DENSE, row: int = 0, scale_row: int = 0) -> str:
    """The driver with ``kernel``'s partial (parameters, arguments, body) and the merge, for
    the template constants; ``row`` and ``scale_row``: the buffers' row lengths in elements
    (values or code words, and scales), d values by default."""
    constants = {name: value for name, value in template if name != "InT"}
    constants.update(NKV=n_kv, MERGE_THREADS=decode.MERGE_THREADS, MAX_SLICES=decode.MAX_SLICES)
    lines = " ".join(f"constexpr int {name} = {value};" for name, value in constants.items())
    dtype = dict(template)["InT"]
    prelude = PRELUDE.replace(
        "inline void __syncthreads()",
        "inline float exp2f(float x) { return std::exp2(x); }\ninline void __syncthreads()",
    )
    driver = DRIVER
    for placeholder, text in (
        ("HEADERS", decode.PARTIAL_HEADER),
        ("CONSTANTS", lines),
        ("PARTIAL_PARAMETERS", kernel.parameters),
        ("PARTIAL_ARGUMENTS", kernel.arguments),
        ("PARTIAL_BODY", kernel.body),
        ("MERGE_BODY", kernel.merge),
        ("MERGE_WARPS", str(kernel.merge_warps or d // 32)),
        ("R_ROWS", str(rows)),
        ("D_DIM", str(d)),
        ("NW_WARPS", str(dict(template)["NW"])),
        ("SCALE_STRIDE", str(scale_row)),
        ("VALUE_STRIDE", str(row or d)),
    ):
        driver = driver.replace(placeholder, text)
    return prelude + f"using T = {CPP_TYPE[dtype]};\n" + driver


CASES = [
    (1, 8, 2, 1, 70, 80, 64, mx.bfloat16),  # a decode step, keys read from a larger buffer
    (1, 4, 1, 3, 45, 45, 128, mx.float32),  # a causal verify pass over grouped heads
    (2, 2, 2, 1, 5, 9, 32, mx.float32),  # two rows, a cache shorter than a slice
]


@pytest.mark.parametrize("b, heads, kv_heads, n_q, n_keys, capacity, d, dtype", CASES)
def test_the_kernels_source_equals_mlxs_attention(tmp_path, b, heads, kv_heads, n_q, n_keys, capacity, d, dtype):
    _check(tmp_path, (b, heads, kv_heads, n_q, n_keys, capacity, d, dtype), counted=False)


@pytest.mark.parametrize(
    "b, heads, kv_heads, n_q, n_keys, capacity, d, dtype",
    [
        (1, 8, 2, 1, 70, 400, 64, mx.bfloat16),  # slices planned for the capacity, cut from the count
        (1, 8, 2, 1, 9, 1032, 64, mx.bfloat16),  # fewer keys than slices: some slices empty
        (1, 4, 1, 3, 45, 64, 128, mx.float32),  # a causal verify pass: the count sets the diagonal
        (1, 4, 1, 3, 45, 736, 128, mx.float32),  # slices of two keys: the last ones past some rows
        (2, 2, 2, 1, 5, 9, 32, mx.float32),
    ],
)
def test_the_counted_kernels_source_reads_only_the_counted_keys(
    tmp_path, b, heads, kv_heads, n_q, n_keys, capacity, d, dtype
):
    """The kernel a compiled step runs over the whole buffer, its shapes the capacity's: the
    keys past the count (random, not zeros) must not reach the result."""
    _check(tmp_path, (b, heads, kv_heads, n_q, n_keys, capacity, d, dtype), counted=True)


def test_a_warp_walks_a_long_slice_in_several_passes(tmp_path, monkeypatch):
    """Slices longer than one pass of a warp's loop (its lane groups' loads): the running
    softmax carries across passes, and the groups merge after."""
    monkeypatch.setattr(decode, "KEYS_PER_WARP", 128)
    template, _, _ = decode.plan(1, 8, 2, 1, 300, 64, mx.bfloat16)
    per_pass = 32 // dict(template)["LPK"] * dict(template)["KPL"]
    assert per_pass > 1 and 300 / decode.WARPS > 2 * per_pass
    _check(tmp_path, (1, 8, 2, 1, 300, 310, 64, mx.bfloat16), counted=False)


def _check(tmp_path, shape, counted: bool) -> None:
    b, heads, kv_heads, n_q, n_keys, capacity, d, dtype = shape
    mx.random.seed(3)
    q = mx.random.normal((b, heads, n_q, d)).astype(dtype)
    k = mx.random.normal((b, kv_heads, capacity, d)).astype(dtype)
    v = mx.random.normal((b, kv_heads, capacity, d)).astype(dtype)
    template, slices, blocks = decode.plan(b, heads, kv_heads, n_q, capacity if counted else n_keys, d, dtype)
    rows = heads // kv_heads * n_q
    for name, a in (("q", q), ("k", k), ("v", v)):
        (tmp_path / f"{name}.bin").write_bytes(raw_values(a).tobytes())
    kernel = COUNTED if counted else DENSE
    build(tmp_path, _source(template, rows, kv_heads, d, kernel))
    ours = _run(tmp_path, shape, slices, blocks, slices // kernel.slices_a_block)
    mask = None if n_q == 1 else "causal"
    scale = d**-0.5
    theirs = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32),
        k[:, :, :n_keys].astype(mx.float32),
        v[:, :, :n_keys].astype(mx.float32),
        scale=scale,
        mask=mask,
    )
    tol = 2e-2 if dtype == mx.bfloat16 else 1e-5
    assert mx.allclose(ours, theirs, atol=tol, rtol=tol).item(), mx.abs(ours - theirs).max().item()


def _run(tmp_path, shape, slices: int, blocks: int, grid_y: int) -> mx.array:
    """The built kernels' output for ``shape`` (b, heads, kv heads, queries, keys, capacity, d,
    dtype), ``grid_y`` blocks along the slices."""
    b, heads, kv_heads, n_q, n_keys, capacity, d, dtype = shape
    for name in ("ks", "kb", "vs", "vb"):  # the quantized cache's scales and biases, or nothing
        if not (tmp_path / f"{name}.bin").exists():
            (tmp_path / f"{name}.bin").write_bytes(b"")
    run = subprocess.run(
        ["./kernel", *map(str, (b, kv_heads, n_keys, capacity, slices, blocks, repr(d**-0.5), grid_y))],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint16 if dtype == mx.bfloat16 else np.float32)
    ours = mx.array(raw).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(raw)
    return ours.reshape(b, heads, n_q, d).astype(mx.float32)


@pytest.mark.parametrize(
    "n_q, bits, group, dtype",
    [(1, 4, 64, mx.bfloat16), (3, 8, 32, mx.float32)],
)
def test_the_quantized_caches_source_equals_attention_over_the_dequantized_cache(tmp_path, n_q, bits, group, dtype):
    b, heads, kv_heads, n_keys, capacity, d = 1, 8, 2, 70, 80, 64
    mx.random.seed(5)
    q = mx.random.normal((b, heads, n_q, d)).astype(dtype)
    codes = {}
    for name in ("k", "v"):
        full = mx.random.normal((b, kv_heads, capacity, d)).astype(dtype)
        codes[name] = mx.quantize(full, group_size=group, bits=bits)
    template, slices, blocks = shared.plan(b, heads, kv_heads, n_q, n_keys, d, dtype, bits, (group, group))
    (tmp_path / "q.bin").write_bytes(raw_values(q).tobytes())
    for name, (w, scales, biases) in codes.items():
        (tmp_path / f"{name}.bin").write_bytes(np.array(w).tobytes())
        (tmp_path / f"{name}s.bin").write_bytes(raw_values(scales).tobytes())
        (tmp_path / f"{name}b.bin").write_bytes(raw_values(biases).tobytes())
    source = _source(template, heads // kv_heads * n_q, kv_heads, d, QUANTIZED, d * bits // 32, d // group)
    build(tmp_path, source)
    ours = _run(tmp_path, (b, heads, kv_heads, n_q, n_keys, capacity, d, dtype), slices, blocks, slices)
    k, v = (mx.dequantize(*codes[n], group_size=group, bits=bits)[:, :, :n_keys].astype(mx.float32) for n in "kv")
    mask = None if n_q == 1 else "causal"
    theirs = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=d**-0.5, mask=mask)
    tol = 2e-2 if dtype == mx.bfloat16 else 1e-5
    assert mx.allclose(ours, theirs, atol=tol, rtol=tol).item(), mx.abs(ours - theirs).max().item()
