"""The small-row product kernels' source built by NVIDIA's compiler for a Hopper GPU, where one
is installed: what MLX's runtime compiler would refuse is caught off the GPU, and so are
register spills, which would turn a step's weight read into local-memory traffic.

The body is wrapped the way ``mx.fast.cuda_kernel`` wraps it (each input a pointer, the
packed weight's shape beside it, the template constants as the launch gives them), with
stand-ins for the one MLX header the activation epilogue includes. Skipped without nvcc.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from engine.models import quantized_matmul_cuda as qmv

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build for the GPU")

# What MLX's unary_ops.cuh gives the activation epilogue: a sigmoid in the activations' type.
_SIGMOID = """
struct Sigmoid {
  template <typename T> __device__ T operator()(T x) { return T(1.f / (1.f + expf(-static_cast<float>(x)))); }
};
"""


def _kernel(rows: int, splits: int, residual: bool, glu: bool, norm: bool, loop: str) -> str:
    names = ["x", "w", "scales", "biases"] + ["residual"] * residual + ["norm"] * norm
    types = {"w": "uint32_t"}
    params = ", ".join(f"const {types.get(n, 'T')}* {n}" for n in names)
    constants = (
        f"using T = __nv_bfloat16; constexpr int R = {rows}; constexpr int BITS = 4; constexpr int GS = 64; "
        f"constexpr int CPW = {qmv.COLUMNS}; constexpr int NW = {qmv.WARPS}; constexpr int KS = {splits}; "
        "constexpr int KN = 2560; constexpr int EPS = 897988541;"
    )
    return (
        "#include <cuda_bf16.h>\n#include <cstdint>\n"
        + loop
        + _SIGMOID
        + qmv.compact(qmv.DEVICE_FUNCTIONS)
        + constants
        + f'\nextern "C" __global__ void product({params}, const int32_t* w_shape, T* out) {{\n'
        + qmv.compact(qmv.kernel_source(residual, glu, norm))
        + "}\n"
    )


def _build(tmp_path, source: str) -> tuple[int, int]:
    """Registers a thread and bytes spilled, as the assembler reports them for sm_90."""
    (tmp_path / "k.cu").write_text(source)
    done = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", "k.cubin", "k.cu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr))
    return registers, spilled


LOOPS = {
    "plain": {},
    "unrolled": {qmv.UNROLL_ENV: "2"},
    "prefetched": {qmv.PREFETCH_ENV: "1"},
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "rows, splits, residual, glu, norm",
    [(1, 1, False, True, True), (1, 4, True, False, False), (4, 2, False, False, True), (8, 1, False, True, False)],
    ids=str,
)
def test_every_walk_of_the_product_builds_without_spilling(
    monkeypatch, tmp_path, loop, rows, splits, residual, glu, norm
):
    monkeypatch.delenv(qmv.UNROLL_ENV, raising=False)
    monkeypatch.delenv(qmv.PREFETCH_ENV, raising=False)
    for name, value in LOOPS[loop].items():
        monkeypatch.setenv(name, value)
    registers, spilled = _build(tmp_path, _kernel(rows, splits, residual, glu, norm, qmv.chunk_loop()))
    assert spilled == 0
    assert registers <= 255


def test_a_macro_in_an_unroll_pragma_is_refused_as_the_runtime_compiler_refuses_it(tmp_path):
    """The check can fail: ``#pragma unroll`` does not expand macros, so a count given as one
    does not build (the unrolled walk's count is a constant for that reason)."""
    loop = "#define CHUNK_UNROLL\n#define CHUNK_UNROLL_COUNT 2\n"
    with pytest.raises(AssertionError, match="CHUNK_UNROLL_COUNT"):
        _build(tmp_path, _kernel(1, 1, False, False, False, loop))
