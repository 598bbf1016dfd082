"""Quantized matrix products of a few rows (decode steps, verify passes, small batches) in one
CUDA kernel that reads each weight once, for affine 4- and 8-bit weights (2, 3, 5 and 6 bits
computed too, routed when asked: ``UNTIMED_BITS``).

A decode step multiplies one to a few rows of activations by every weight matrix of the
model, so its cost is reading the weights. MLX's own kernel on CUDA took 2-7x that floor
for one row, and 2-6 rows cost about as many one-row products (an H200, 4-bit g64; see
``python -m engine.cli.bench_qmm --ours``): a verify pass of 5 rows cost 3-4 decode steps.

Here each warp owns ``COLUMNS`` output columns (weight rows). Its lanes walk the input
dimension in chunks of 16 bytes of codes (32 4-bit or 16 8-bit values, all within one
quantization group since groups are 32, 64 or 128 values; 32 codes in 3, 5 or 6 words at
those widths), so a warp's loads of a weight
row are contiguous and coalesced. A chunk lies in one quantization group, so a lane turns
each code into a float once (a logic op and a subtraction, ``word_codes``), multiplies it
into every row of ``x`` it holds a sum for, and applies the column's scale and bias once a
chunk (``scale * (x . codes) + bias * sum(x)``, as MLX's Metal kernel does): the weights are
read once whatever the row count, and the activations (a few KB, in L1/L2) are read once per
column set. The lanes' float32 sums meet in a warp-shuffle reduction.

Every row is computed by the same float operations in the same order whatever the number
of rows, so a row's output does not depend on the rows beside it (a verify pass computes
what the decode steps would).

A decode step is bound by its launches as much as by its reads, so the kernel also takes the
small ops around a product into it: the residual add in its epilogue (``residual``), a gated
MLP's ``silu(gate) * up`` in the stacked gate/up product's epilogue (``glu``: a warp's columns
are half gate rows, half the matching up rows), and the RMSNorm before a product in its
prologue (``norm``: each block norms the rows into shared memory, then reads them there).

Which products take the kernel (and the small ops with them) is models.quantized_routing's
to say; here are the kernel, what it ``fits`` and ``takes``, and its switch ``enabled``
(``MLX_DESK_QMV=0`` turns it off; on by default since every test of it passed on an H200,
docs/qmv.md).

Expert products of a decode step go through the same body: models.gathered_matmul_cuda. The
body and the device functions it calls are C++ text in models.quantized_matmul_device.
"""

from __future__ import annotations

import re
import struct
from functools import cache

import mlx.core as mx

from engine.models.cuda_build import cuda_kernel, launch_bounds
from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_device import DEVICE_FUNCTIONS

# Output columns per warp: each lane holds ROWS x COLUMNS float32 sums, and the activations
# a lane reads serve COLUMNS weight rows. Warps per block: blocks of 128 threads.
COLUMNS = 4
WARPS = 4
# Warps to aim for across the grid when splitting K (K-splits stop once reached): about
# 32 a streaming multiprocessor on an H200 (132 of them), enough loads in flight to keep
# its memory busy.
TARGET_WARPS = 4096
# The most rows the kernel takes (its per-lane sums live in registers: 16 x 4 of them).
MAX_ROWS = 16
BITS = (4, 8)
# Widths the kernel computes but routes only when asked (``MLX_DESK_QMV_OTHER_BITS=1``) until a
# GPU has timed them against MLX's. 2-bit words hold 16 codes, so a lane's 16 bytes are 64
# values and lie in one group only for groups of 64 or 128. 3, 5 and 6 bits run end to end
# across words as MLX packs them: a lane's chunk is 32 codes in 3, 5 or 6 words
# (``ChunkShape``). Where a lane's codes and sums outgrow its registers the rows stop short of
# ``MAX_ROWS`` (``ROW_LIMITS``: NVIDIA's compiler spills 2-bit products at 16 rows, a word's 16
# codes a column held as floats, and 5-bit ones, five words a column, at 16).
UNTIMED_BITS = (2, 3, 5, 6)
# Float modes the kernel computes (bits, group size), routed only when asked
# (``MLX_DESK_QMV_FLOAT_MODES=1``) until timed: E2M1 or E4M3 codes, no biases; one E8M0 scale a
# group of 32 (MX), or one E4M3 scale a group of 16 (NVFP4: two groups a lane's chunk of 32
# codes, so its K must be a multiple of 32).
FLOAT_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
# Quantization groups a lane's chunk of codes spans: one, except NVFP4's two (the kernel scales
# each half of the chunk by its own group's scale).
CHUNK_GROUPS = {"nvfp4": 2}
MODE_IDS = {"affine": 0, "mxfp4": 1, "mxfp8": 2, "nvfp4": 3}
FLOAT_MODES_ENV = "MLX_DESK_QMV_FLOAT_MODES"
ROW_LIMITS = {2: 8, 5: 12}
OTHER_BITS_ENV = "MLX_DESK_QMV_OTHER_BITS"
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ENV = "MLX_DESK_QMV"
# How a lane walks its chunks of K, two ways asked for by name until measured (both left off;
# each lane's sums run in the same order either way, so outputs do not change). Inside a step
# the products read at a quarter to a third of the copy rate (docs/qmv.md, "MLX's CUDA
# graphs"): a lane's few chunks each wait for their loads in turn. ``MLX_DESK_QMV_UNROLL=N``
# (2-8) tells the compiler to unroll the loop N times, so later chunks' loads may issue before
# earlier ones are multiplied; ``MLX_DESK_QMV_PREFETCH=1`` loads each chunk while the one
# before it is multiplied (double buffering in registers: 110-128 a thread against 78-120 for
# one row, so fewer warps a multiprocessor). The prefetch wins where both are asked for. Measured on an
# H100 (docs/qmv.md, "Registers"): the prefetch cost qwen3-4b's decode 7%.
UNROLL_ENV = "MLX_DESK_QMV_UNROLL"
PREFETCH_ENV = "MLX_DESK_QMV_PREFETCH"
# Launch bounds for the product's build (``MLX_DESK_QMV_BOUNDS``: 0 for one block of WARPS warps,
# N for that and N blocks a multiprocessor; none by default, as MLX builds a kernel). Without
# them the compiler gave the one-row product 120 registers a thread against 56 with them
# (models.cuda_build): 16 warps a multiprocessor against 36. Measured on an H100 (docs/qmv.md,
# "Registers"): decode within the noise, the products being bound by their instructions.
BOUNDS_ENV = "MLX_DESK_QMV_BOUNDS"
# One logic op a code (on; ``MLX_DESK_QMV_ONE_OP_CODES=0`` turns it off): the compiler spends two
# on ``(word & mask) | magic`` (its LOP3 takes one immediate and both are constants), about 128
# of the 676 instructions of a chunk of the gate/up variant's loop (NVIDIA's compiler, sm_90);
# the inline ``lop3`` takes them as registers, 551 (the tensor-core kernel's loop: 450 to 386 at
# one row). The products were measured issuing on 44-63% of cycles (docs/qmv.md, "Registers").
# The same bits either way. On where the warps are wide (below): the pair that was timed, the
# build of the one-row step; elsewhere (3-16 rows, the tensor-core kernel) it was not timed, and
# those builds keep two ops unless the switch is set to 1.
ONE_OP_ENV = "MLX_DESK_QMV_ONE_OP_CODES"
# Wider warps for products of at most ``WIDE_ROWS`` rows (on; ``MLX_DESK_QMV_COLUMNS=4`` turns
# it off): a lane's activations serve 8 weight rows instead of 4, so the loop spends fewer
# instructions a code on them (3.94 a code and column with one-op codes against 4.32, NVIDIA's
# compiler, sm_90) at 166-168 registers. Measured with one-op codes on an H100 (docs/qmv.md,
# "Eight columns and one-op codes on by default"): llama3-8b's products 9-22% faster at 1-2
# rows, qwen3-4b's gate/up and down faster at one row and its q level; qwen3-4b's decode faster
# in each of four rounds against the old build, llama3-8b's within the machine's spread. Only
# the grid changes: K is split as at 4 columns (``k_splits``), so every column's sum runs in
# the same order and the bits do not change.
COLUMNS_ENV = "MLX_DESK_QMV_COLUMNS"
# The first chunk's loads ahead of the norm prologue (``MLX_DESK_QMV_EARLY_LOAD=1``; off: on an
# H100 it moved decode within the machine's spread, medians 276 against 239 tok/s on qwen3-4b
# and 247 against 255 on llama3-8b, and not at all with eight columns; docs/qmv.md, "Memory
# waits"): a normed product of qwen3-4b's K (2,560: one or two chunks a lane) runs as one wave
# whose warps all norm, then all load, then all multiply, so the norm's time and the weights'
# round trip add up; loaded first, the round trip runs under the norm. The same chunks in the
# same order, so the same bits. Ignored with the prefetch, which orders its own loads.
EARLY_ENV = "MLX_DESK_QMV_EARLY_LOAD"
WIDE_ROWS = 2
# Rows x inputs a block norms into its shared memory (``norm_fits``): 6 rows of qwen3-4b's
# 2,560 values in bfloat16, 4 of llama3-8b's 4,096 (static shared memory stops at 48 KB).
NORM_STAGE_BYTES = 32 << 10


def kernel_source(residual: bool = False, glu: bool = False, norm: bool = False, mode: str = "affine") -> str:
    """The kernel's body: ``rows_product`` with template constants as its own (runtime: K from
    the packed weight's width, w_shape[1] words of 32 / BITS codes, so x's shape need not reach
    the kernel whatever its leading axes; N is w_shape[0]), plus ``residual`` added to the
    output, ``glu`` (silu(gate) * up from a stacked gate/up weight, with MLX's own Sigmoid, which ``GLU_HEADER`` includes) and
    ``norm`` (x normed first by the weight ``norm`` and the epsilon whose float bits are EPS).
    A float ``mode`` (``FLOAT_MODES``) reads scale bytes (E8M0, NVFP4's E4M3) and no biases."""
    flags = f"{epilogue_flags(residual, glu)}, {'KN' if norm else 0}"
    tail = ", residual" if residual else ", nullptr"
    tail += ", norm, __int_as_float(EPS)" if norm else ""
    biases = "biases"
    if mode != "affine":
        flags += f", {MODE_IDS[mode]}, uint8_t"
        biases = "(const T*)nullptr"
    return (
        f"rows_product<T, R, BITS, GS, CPW, NW, KS, {flags}>"
        f"(x, w, scales, {biases}, out, w_shape[1] * 32 / BITS, w_shape[0]{tail});\n"
    )


def epilogue_flags(residual: bool, glu: bool) -> str:
    """The epilogue's template arguments, as both product kernels take them: whether a
    residual is added, whether the output is ``silu(gate) * up``, and the sigmoid it uses."""
    return f"{str(residual).lower()}, {str(glu).lower()}, {'Sigmoid' if glu else 'float'}"


def variant_suffix(residual: bool, glu: bool, norm: bool = False) -> str:
    """The kernel name's suffix for its fused ops: each variant is its own build."""
    return "".join(part for part, on in (("_plus", residual), ("_glu", glu), ("_norm", norm)) if on)


_SOURCE = kernel_source()
_RESIDUAL_SOURCE = kernel_source(residual=True)
_GLU_SOURCE = kernel_source(glu=True)
GLU_HEADER = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'


def compact(source: str) -> str:
    """CUDA source without its comments, indentation and blank lines. MLX hashes a custom
    kernel's whole source on every launch to find its build: on an H200 a chain of launches
    took 4.4 us of host time each with 8 KB of source against 3.2 us with one line
    (docs/qmv.md), and a decode step launches this kernel several times a layer."""
    lines = (re.sub(r"//.*", "", line).strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


@cache
def rows_kernel(name: str, inputs: tuple[str, ...], source: str, includes: str = ""):
    """A kernel over the shared device functions (``DEVICE_FUNCTIONS``, after ``includes``)
    writing ``out``, built once per name, inputs and source."""
    return cuda_kernel(
        name=name,
        input_names=list(inputs),
        output_names=["out"],
        source=compact(source),
        header=includes + compact(DEVICE_FUNCTIONS),
    )


def float_bits(value: float) -> int:
    """A float32's bits as a signed int (a kernel's template constant; ``__int_as_float`` there)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def norm_fits(rows: int, inputs: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel can norm ``rows`` rows of ``inputs`` values in its prologue: the
    block keeps them in shared memory, at most ``NORM_STAGE_BYTES``."""
    return rows * inputs * dtype.size <= NORM_STAGE_BYTES


def layout(k: int, n: int, bits: int, glu: bool = False, columns: int = COLUMNS) -> tuple[list[tuple[str, int]], int]:
    """The column and warp layout of a product by an [N, K] matrix: the kernel's template
    parameters for it (``columns`` a warp owns, warps a block, warps that split K) and the
    blocks across N (with ``glu``, across the N / 2 outputs, a warp's columns being half gate
    rows and half up rows)."""
    splits = k_splits(k, n, bits)
    per_warp, outputs = (columns // 2, n // 2) if glu else (columns, n)
    return [("CPW", columns), ("NW", WARPS), ("KS", splits)], -(-outputs // (WARPS // splits * per_warp))


@cache
def _cuda_build() -> bool:
    return mx.cuda.is_available()


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend, on the GPU. (Asked before every
    routed product of an uncompiled step, so the backend's answer is kept.)"""
    return _cuda_build() and mx.default_device() == mx.gpu


def chunk_loop() -> str:
    """The ``#define``s that choose how a lane walks its chunks: prefetched
    (``MLX_DESK_QMV_PREFETCH=1``), unrolled N times (``MLX_DESK_QMV_UNROLL``), or neither."""
    if switch(PREFETCH_ENV, "0") == "1":
        return "#define CHUNK_PREFETCH\n"
    value = switch(UNROLL_ENV, "")
    if not (value.isdigit() and 2 <= int(value) <= 8):
        return ""
    # A constant, not a macro: ``#pragma unroll`` takes a constant expression and does not
    # expand macros in it.
    return f"#define CHUNK_UNROLL\nconstexpr int CHUNK_UNROLL_COUNT = {int(value)};\n"


def bounds() -> str:
    """The launch bounds' header line (``MLX_DESK_QMV_BOUNDS``), or nothing."""
    value = switch(BOUNDS_ENV, "")
    if not (value.isdigit() and int(value) <= 32):
        return ""
    return launch_bounds(WARPS * 32, int(value))


def one_op_codes(default: str) -> str:
    """The ``#define`` that unpacks each code with one logic op, or nothing: as
    ``MLX_DESK_QMV_ONE_OP_CODES`` says (1 or 0), else as ``default`` (the kernel's timed build)."""
    return "#define ONE_OP_CODES\n" if switch(ONE_OP_ENV, default) == "1" else ""


def early_load() -> str:
    """The ``#define`` that loads a lane's first chunk before the norm prologue
    (``MLX_DESK_QMV_EARLY_LOAD=1``), or nothing."""
    return "#define EARLY_LOAD\n" if switch(EARLY_ENV, "0") == "1" else ""


def columns(rows: int) -> int:
    """Columns a warp owns for a product of ``rows`` rows: 8 up to ``WIDE_ROWS`` rows unless
    ``MLX_DESK_QMV_COLUMNS`` says otherwise (4), else ``COLUMNS``."""
    wide = switch(COLUMNS_ENV, str(2 * COLUMNS)) == str(2 * COLUMNS) and rows <= WIDE_ROWS
    return 2 * COLUMNS if wide else COLUMNS


def build_switches(rows: int = 1) -> str:
    """The product's build switches for ``rows`` rows as its header's first lines: how a lane
    walks its chunks, launch bounds, how a code is unpacked (one op by default where the warps
    are wide, the pair that was timed), whether the first chunk is loaded before the norm."""
    one_op = one_op_codes(default="1" if columns(rows) > COLUMNS else "0")
    return chunk_loop() + bounds() + one_op + early_load()


def enabled() -> bool:
    """Whether products are routed to the kernel: not turned off (``MLX_DESK_QMV=0``) and able to run."""
    return switch(ENV, "1") != "0" and available()


def fits(
    rows: int,
    inputs: int,
    outputs: int,
    *,
    bits: int,
    group_size: int,
    mode: str,
    dtype: mx.Dtype,
    scales_dtype: mx.Dtype,
    has_biases: bool,
) -> bool:
    """Whether the kernel takes a product of ``rows`` rows by an [outputs, inputs] weight
    (else ``mx.quantized_matmul`` does). Affine activations, scales and biases share one float
    dtype, so the output's dtype is theirs as MLX's would be; a float mode's scales are
    bytes and it has no biases."""
    if mode == "affine":
        packed = has_biases and bits in routed_bits() and group_size in GROUP_SIZES and scales_dtype == dtype
    else:
        packed = (
            float_modes_on()
            and FLOAT_MODES.get(mode) == (bits, group_size)
            and not has_biases
            and scales_dtype == mx.uint8
        )
    return (
        packed
        and group_size * CHUNK_GROUPS.get(mode, 1) % chunk_values(bits) == 0  # a chunk within its groups
        and inputs % chunk_values(bits) == 0
        and 1 <= rows <= ROW_LIMITS.get(bits, MAX_ROWS)
        and outputs >= 1
        and inputs >= group_size
        and inputs % group_size == 0
        and dtype in DTYPES
    )


def float_modes_on() -> bool:
    """Whether float-mode products are routed to the kernel (``MLX_DESK_QMV_FLOAT_MODES=1``)."""
    return switch(FLOAT_MODES_ENV, "0") == "1"


def routed_bits() -> tuple[int, ...]:
    """The code widths products are routed to the kernel for: ``BITS``, and 2, 3, 5 and 6 with
    ``MLX_DESK_QMV_OTHER_BITS=1``."""
    return BITS + (UNTIMED_BITS if switch(OTHER_BITS_ENV, "0") == "1" else ())


def chunk_values(bits: int) -> int:
    """Values in a lane's chunk of a column (the kernel's ``ChunkShape``): 16 bytes of codes
    where the width divides 32, else 32 codes end to end."""
    return 128 // bits if 32 % bits == 0 else 32


def k_splits(inputs: int, outputs: int, bits: int) -> int:
    """Warps that split the input dimension of one column set (1, 2 or 4 of a block's warps).

    Splitting puts more warps, so more loads, in flight where a matrix has few columns for
    its length (down projections: 2,560 x 9,728); it stops while every lane of a warp still
    has a chunk of codes and once the grid holds ``TARGET_WARPS``. It depends on the
    matrix only, never on the rows, so a row's sums run in the same order at any row count."""
    chunks = inputs // chunk_values(bits)
    column_sets = -(-outputs // COLUMNS)
    splits = 1
    while splits < WARPS and chunks >= 2 * splits * 32 and column_sets * splits < TARGET_WARPS:
        splits *= 2
    return splits


def matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    residual: mx.array | None = None,
    glu: bool = False,
    norm: tuple[mx.array, float] | None = None,
    mode: str = "affine",
) -> mx.array:
    """``x @ dequantize(w).T`` for ``x`` [..., K] and an [N, K] weight packed as MLX packs it
    (``w`` uint32 [N, K * bits / 32], ``scales``/``biases`` [N, K / group_size]), plus
    ``residual`` ([..., N] in x's dtype) where given, as ``residual + product`` computes it.
    With ``glu`` the weight stacks gate over up rows and the output is ``silu(gate) * up``
    ([..., N / 2]), as MLX's ops compute it from the product. With ``norm`` (weight, eps), the
    product of ``mx.fast.rms_norm(x, weight, eps)`` (``norm_fits`` says for which rows). A
    float ``mode`` takes its scale bytes and no biases. The caller checks ``fits``."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    outputs = n // 2 if glu else n
    # The kernel reads rows of K from a row-contiguous x whatever its leading axes, so x and
    # the residual go in as they are and the output comes out in x's leading shape: no views
    # around the launch (each is a node the host builds and hands over every step).
    rows = x.size // max(k, 1)
    warps, blocks = layout(k, n, bits, glu, columns(rows))
    names, inputs = ["x", "w", "scales"], [x, w, scales]
    if mode == "affine":
        names.append("biases")
        inputs.append(biases)
    if residual is not None:
        names.append("residual")
        inputs.append(residual)
    constants = []
    if norm is not None:
        names.append("norm")
        inputs.append(norm[0])
        constants = [("KN", k), ("EPS", float_bits(norm[1]))]
    variant = variant_suffix(residual is not None, glu, norm is not None) + ("" if mode == "affine" else f"_{mode}")
    source = kernel_source(residual is not None, glu, norm is not None, mode)
    includes = build_switches(rows) + (GLU_HEADER if glu else "")
    kernel = rows_kernel(f"quantized_matmul_rows{variant}", tuple(names), source, includes)
    (out,) = kernel(
        inputs=inputs,
        template=[("T", x.dtype), ("R", rows), ("BITS", bits), ("GS", group_size), *warps, *constants],
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*lead, outputs)],
        output_dtypes=[x.dtype],
    )
    return out


def takes(
    rows: int,
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
) -> bool:
    """Whether the kernel takes ``rows`` rows of ``x`` by the packed weight ``w`` (its last two
    axes [N, K * bits / 32]): the packing says these bits, and ``fits``."""
    return (
        w.dtype == mx.uint32
        and x.shape[-1] * bits == w.shape[-1] * 32
        and fits(
            rows,
            x.shape[-1],
            w.shape[-2],
            bits=bits,
            group_size=group_size,
            mode=mode,
            dtype=x.dtype,
            scales_dtype=scales.dtype,
            has_biases=biases is not None and biases.dtype == scales.dtype,
        )
    )
