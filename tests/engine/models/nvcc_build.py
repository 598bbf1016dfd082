"""Our CUDA kernels' source as MLX's runtime compiler receives it, built by NVIDIA's compiler for
sm_90 (nvcc on PATH): the wrapping ``mx.fast.cuda_kernel`` gives a body (each input a pointer with
its shape, strides and dimensions beside it, each output a pointer, the template constants as
the launch gives them), a stand-in for the one MLX header the activation epilogue includes, and
the build's registers and spills. Used by tests/engine/models/test_cuda_builds.py and
tests/gpu/kernel_registers.py."""

from __future__ import annotations

import re

import mlx.core as mx

from engine.models import decode_attention_cuda as dense_attention
from engine.models import quantized_attention_cuda as quantized_attention
from engine.models import quantized_matmul_cuda as qmv
from tests.engine.models.cuda_on_cpu import compile_source

# What MLX's unary_ops.cuh gives the activation epilogue: a sigmoid in the activations' type.
SIGMOID = """
struct Sigmoid {
  template <typename T> __device__ T operator()(T x) { return T(1.f / (1.f + expf(-static_cast<float>(x)))); }
};
"""


C_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t"}


def constant(name: str, value) -> str:
    """A template constant as MLX's wrapper declares it: a dtype, a bool or an int."""
    if isinstance(value, mx.Dtype):
        return f"using {name} = {C_TYPES[value]};"
    if isinstance(value, bool):
        return f"constexpr bool {name} = {str(value).lower()};"
    return f"constexpr int {name} = {value};"


def wrapped(inputs: dict[str, str], outputs: dict[str, str], constants, header: str, body: str) -> str:
    """A kernel as MLX's runtime compiler receives it: ``inputs`` and ``outputs`` name -> C
    type, ``constants`` (name, dtype or int) as the launch's template gives them."""
    params = [
        f"const {t}* {n}, const int32_t* {n}_shape, const int64_t* {n}_strides, int {n}_ndim" for n, t in inputs.items()
    ] + [f"{t}* {n}" for n, t in outputs.items()]
    lines = [constant(n, v) for n, v in constants]
    return (
        "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"
        + header
        + "\n".join(lines)
        + f'\nextern "C" __global__ void kernel({", ".join(params)}) {{\n{body}}}\n'
    )


def product(
    rows: int,
    splits: int,
    residual: bool,
    glu: bool,
    norm: bool,
    loop: str,
    columns: int = qmv.COLUMNS,
    bits: int = 4,
    mode: str = "affine",
) -> str:
    """The product kernel as MLX builds it for bfloat16 rows (a float ``mode``: its bits and
    group, its scale bytes and no biases; else affine ``bits`` in groups of 64)."""
    bits, group = qmv.FLOAT_MODES.get(mode, (bits, 64))
    names = ["x", "w", "scales"] + ["biases"] * (mode == "affine") + ["residual"] * residual + ["norm"] * norm
    types = {"w": "uint32_t", "scales": "T" if mode == "affine" else "uint8_t"}
    constants = [("T", mx.bfloat16), ("R", rows), ("BITS", bits), ("GS", group), ("CPW", columns), ("NW", qmv.WARPS)]
    constants += [("KS", splits), ("KN", 2560), ("EPS", qmv.float_bits(1e-6))]
    return wrapped(
        {n: types.get(n, "T") for n in names},
        {"out": "T"},
        constants,
        loop + SIGMOID + qmv.compact(qmv.DEVICE_FUNCTIONS),
        qmv.compact(qmv.kernel_source(residual, glu, norm, mode)),
    )


def build(tmp_path, source: str) -> tuple[int, int]:
    """Registers a thread and bytes spilled, as the assembler reports them for sm_90."""
    report = compile_source(
        tmp_path, "k.cu", source, ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", "k.cubin", "k.cu"]
    )
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    return registers, spilled


PARTS = {"part_acc": "float", "part_max": "float", "part_sum": "float"}


# qwen3-4b's step (32 heads over 8, 128 dimensions), a verify pass of 5 over 8 heads of 64, and
# llama3-8b's pass of 4 queries.
PASSES = [(32, 8, 1, 520, 128), (8, 8, 5, 2000, 64), (32, 8, 4, 6000, 128)]


def dense_partial(heads: int, kv_heads: int, queries: int, keys: int, dims: int) -> str:
    """The split decode attention's partial kernel for one pass, as it is built."""
    template, _, _ = dense_attention.plan(1, heads, kv_heads, queries, keys, dims, mx.bfloat16)
    inputs = {"q": "InT", "sc": "float", "k": "InT", "v": "InT"}
    return wrapped(inputs, PARTS, template, dense_attention.PARTIAL_HEADER, dense_attention.PARTIAL_SOURCE)


def quantized_partial(heads: int, kv_heads: int, queries: int, keys: int, dims: int, bits: int) -> str:
    """The quantized cache's partial kernel for one pass (groups of 64), as it is built."""
    template, _, _ = quantized_attention.plan(1, heads, kv_heads, queries, keys, dims, mx.bfloat16, bits, (64, 64))
    codes = {f"{kv}{part}": "uint32_t" if part == "w" else "InT" for kv in "kv" for part in "wsb"}
    inputs = {"q": "InT", "sc": "float", **codes}
    return wrapped(inputs, PARTS, template, quantized_attention._HEADER, quantized_attention.PARTIAL_SOURCE)
