"""Quantized matrix products of a few rows (decode steps, verify passes, small batches) in one
CUDA kernel that reads each weight once, for affine 4- and 8-bit weights.

A decode step multiplies one to a few rows of activations by every weight matrix of the
model, so its cost is reading the weights. MLX's own kernel on CUDA took 2-7x that floor
for one row, and 2-6 rows cost about as many one-row products (an H200, 4-bit g64; see
``python -m engine.cli.bench_qmm --ours``): a verify pass of 5 rows cost 3-4 decode steps.

Here each warp owns ``COLUMNS`` output columns (weight rows). Its lanes walk the input
dimension in chunks of 16 bytes of codes (32 4-bit or 16 8-bit values, all within one
quantization group since groups are 32, 64 or 128 values), so a warp's loads of a weight
row are contiguous and coalesced. A chunk lies in one quantization group, so a lane turns
each code into a float once (one logic op and one subtraction, ``word_codes``), multiplies it
into every row of ``x`` it holds a sum for, and applies the column's scale and bias once a
chunk (``scale * (x . codes) + bias * sum(x)``, as MLX's Metal kernel does): the weights are
read once whatever the row count, and the activations (a few KB, in L1/L2) are read once per
column set. The lanes' float32 sums meet in a warp-shuffle reduction.

Every row is computed by the same float operations in the same order whatever the number
of rows, so a row's output does not depend on the rows beside it (a verify pass computes
what the decode steps would).

Routing: ``quantized_matmul`` takes the kernel where ``fits`` and ``pays`` say so and MLX's
CUDA backend runs on the GPU, unless the environment variable ``MLX_DESK_QMV`` is ``0``
(on by default since every test of it passed on an H200, docs/qmv.md); everything else
(other modes and bit widths, more rows, the CPU) keeps ``mx.quantized_matmul``. On CUDA a
batch's rows ([B, L, K]) reach MLX's kernel as one matrix, with ours on or off: MLX runs
the leading axis as that many separate products, each reading the whole weight.

Expert products of a decode step go through the same body: models.gathered_matmul_cuda.
"""

from __future__ import annotations

import os
import re
from functools import cache

import mlx.core as mx
import mlx.nn as nn

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
# Where the kernel is routed (measured on an H200, 4-bit g64, docs/qmv.md): from 2 to 7 rows
# it beats or ties MLX's kernel on every projection (MLX runs up to 7 rows as that many
# one-row products: qwen3-4b's gate+up at 7 rows 205 us against ours 65). From 8 rows MLX's
# tiled kernel wins a microbenchmark of 32 independent products in flight (30 against 64 us),
# but not a step, where each product waits for the one before: qwen3-4b's batch step of 8
# rows took 7.4 ms through ours against 12.0 through MLX's, 12 streams decoded at 814 against
# 783 tok/s, and 16 at 874 against 964, so up to 12 rows route here. At one row it wins only
# on large matrices (llama3-8b's gate+up 49 us against 75, its down 37 against 41) and loses
# on small ones (qwen3-4b's q, 2560x4096: 15.3 us against 13.1), so one row routes from 16M
# weights.
ROUTED_ROWS = range(2, 13)
ONE_ROW_MIN_WEIGHTS = 16 << 20
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ENV = "MLX_DESK_QMV"
# The residual add in the product's epilogue: ``1`` turns it on (``residual_enabled``).
RESIDUAL_ENV = "MLX_DESK_QMV_RESIDUAL"

_HEADER = """
// The PW codes of one word of packed weights as floats, without a shift or an int-to-float
// conversion per code (an H200 has about as few issue slots as bytes of bandwidth for a
// one-row product of a wide matrix): a code at bit p is kept in place under the exponent of 2^(23 - p), which makes
// the float 2^(23 - p) + code in one logic op, and subtracting 2^(23 - p) leaves the code
// exactly. Codes whose bits would reach the exponent (from bit 20 of 4-bit words, bit 16 of
// 8-bit ones) are taken from the word's high half, one shift for all of them.
template <int BITS>
__device__ __forceinline__ void word_codes(uint32_t word, float* out) {
  constexpr int PW = 32 / BITS;
  constexpr uint32_t CODE = (1u << BITS) - 1u;
  const uint32_t high = word >> 16;
#pragma unroll
  for (int i = 0; i < PW; ++i) {
    const int bit = i * BITS;
    const bool low = bit + BITS <= 23;
    const int p = low ? bit : bit - 16;
    const uint32_t magic = (uint32_t)(150 - p) << 23;
    out[i] = __int_as_float(((low ? word : high) & (CODE << p)) | magic) - (float)(1u << (23 - p));
  }
}

// P consecutive values of T from p as floats: 16- or 8-byte loads when p is aligned for them
// (the caller checks the array's base; offsets are multiples of the load size), else one by one.
template <typename T, int P>
__device__ __forceinline__ void load_floats(const T* p, float* out, bool aligned) {
  constexpr int BYTES = P * (int)sizeof(T);
  if constexpr (BYTES % 16 == 0) {
    if (aligned) {
      constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
      for (int v = 0; v < BYTES / 16; ++v) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[v];
        const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int i = 0; i < PER; ++i) out[v * PER + i] = static_cast<float>(t[i]);
      }
      return;
    }
  } else if constexpr (BYTES == 8) {
    if (aligned) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < P; ++i) out[i] = static_cast<float>(t[i]);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) out[i] = static_cast<float>(p[i]);
}
"""

# The kernels' shared body, a device function: the plain product calls it once per block,
# the gathered one (models.gathered_matmul_cuda) with each (token, expert) pair's pointers.
_PRODUCT = """
// out[r, n] = sum_k x[r, k] * dequantize(w)[n, k] for R rows of x [R, K] and one [N, K]
// weight packed as MLX packs it, for the column sets of this block (blockIdx.x).
// T: activations, scales, biases and output; R: rows; BITS; GS: group size; CPW: columns
// per warp; NW: warps per block; KS: warps splitting K for one column set; RES: whether
// residual [R, N] is added to the output (rounded to T first, then added in float32 and
// rounded again: what the product and a separate add compute).
template <typename T, int R, int BITS, int GS, int CPW, int NW, int KS, bool RES = false>
__device__ __forceinline__ void rows_product(
    const T* x, const uint32_t* w, const T* scales, const T* biases, T* out, const int K, const int N,
    const T* residual = nullptr) {
  constexpr int PW = 32 / BITS;        // codes per 32-bit word
  constexpr int VPL = 4 * PW;          // values per lane chunk (one 16-byte load of codes)
  constexpr int CG = NW / KS;          // column sets per block; KS warps share each one
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int part = warp % KS;          // this warp's strips of K: chunks part*32 + 32*KS*i
  const int col0 = (blockIdx.x * CG + warp / KS) * CPW;
  const int chunks = K / VPL;          // K is a multiple of the group size, so of VPL
  const int words_per_row = K / PW;
  const int groups_per_row = K / GS;
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;
  const bool w_aligned = (reinterpret_cast<unsigned long long>(w) & 15ull) == 0;

  // Columns past N repeat the last one (valid memory) and are never written: every warp
  // runs to the end, since the block meets at a barrier when KS > 1.
  long wrow[CPW], srow[CPW];
#pragma unroll
  for (int j = 0; j < CPW; ++j) {
    const int n = min(col0 + j, N - 1);
    wrow[j] = (long)n * words_per_row;
    srow[j] = (long)n * groups_per_row;
  }

  float acc[R][CPW];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < CPW; ++j) acc[r][j] = 0.f;
  }

  for (int c = part * 32 + lane; c < chunks; c += KS * 32) {
    // Load every column's codes, scale and bias for this chunk first (loads in flight together).
    uint32_t q[CPW][4];
    float s[CPW], b[CPW];
    const int group = (c * VPL) / GS;
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
      const uint32_t* src = w + wrow[j] + (long)c * 4;
      if (w_aligned) {
        const uint4 u = *reinterpret_cast<const uint4*>(src);
        q[j][0] = u.x; q[j][1] = u.y; q[j][2] = u.z; q[j][3] = u.w;
      } else {
#pragma unroll
        for (int t = 0; t < 4; ++t) q[j][t] = src[t];
      }
      s[j] = static_cast<float>(scales[srow[j] + group]);
      b[j] = static_cast<float>(biases[srow[j] + group]);
    }
    // The chunk lies in one quantization group, so its sum is scale * (x . codes) + bias *
    // sum(x) per row and column: the codes are multiplied into the rows as they are, and each
    // column's scale and bias are applied once a chunk.
    float dot[R][CPW], xsum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      xsum[r] = 0.f;
#pragma unroll
      for (int j = 0; j < CPW; ++j) dot[r][j] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      float codes[CPW][PW];
#pragma unroll
      for (int j = 0; j < CPW; ++j) word_codes<BITS>(q[j][t], codes[j]);
      const int k = c * VPL + t * PW;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float xf[PW];
        load_floats<T, PW>(x + (long)r * K + k, xf, x_aligned);
#pragma unroll
        for (int i = 0; i < PW; ++i) xsum[r] += xf[i];
#pragma unroll
        for (int j = 0; j < CPW; ++j) {
#pragma unroll
          for (int i = 0; i < PW; ++i) dot[r][j] = fmaf(xf[i], codes[j][i], dot[r][j]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < CPW; ++j) acc[r][j] += fmaf(s[j], dot[r][j], b[j] * xsum[r]);
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][j] += __shfl_xor_sync(0xffffffff, acc[r][j], o);
    }
  }
  if constexpr (KS > 1) {
    // The KS warps of a column set add their sums in shared memory, always in warp order.
    __shared__ float partial[NW][R][CPW];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < CPW; ++j) partial[warp][r][j] = acc[r][j];
      }
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < CPW; ++j) {
        float total = partial[warp][r][j];
#pragma unroll
        for (int p = 1; p < KS; ++p) total += partial[warp + p][r][j];
        acc[r][j] = total;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < CPW; ++j) {
        if (col0 + j >= N) continue;
        const long o = (long)r * N + col0 + j;
        if constexpr (RES) {
          out[o] = static_cast<T>(static_cast<float>(residual[o]) + static_cast<float>(static_cast<T>(acc[r][j])));
        } else {
          out[o] = static_cast<T>(acc[r][j]);
        }
      }
    }
  }
}
"""

# The device code every variant's kernel is built on (its header).
DEVICE_FUNCTIONS = _HEADER + _PRODUCT

# Template constants as ``rows_product``'s. Runtime: K (x_shape[1]), N (w_shape[0]).
_SOURCE = """
  rows_product<T, R, BITS, GS, CPW, NW, KS>(x, w, scales, biases, out, x_shape[1], w_shape[0]);
"""

# The same with a residual added to the output (``matmul``'s ``residual``).
_RESIDUAL_SOURCE = """
  rows_product<T, R, BITS, GS, CPW, NW, KS, true>(x, w, scales, biases, out, x_shape[1], w_shape[0], residual);
"""


def compact(source: str) -> str:
    """CUDA source without its comments, indentation and blank lines. MLX hashes a custom
    kernel's whole source on every launch to find its build: on an H200 a chain of launches
    took 4.4 us of host time each with 8 KB of source against 3.2 us with one line
    (docs/qmv.md), and a decode step launches this kernel several times a layer."""
    lines = (re.sub(r"//.*", "", line).strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


@cache
def rows_kernel(name: str, inputs: tuple[str, ...], source: str):
    """A kernel over the shared device functions (``DEVICE_FUNCTIONS``) writing ``out``, built
    once per name, inputs and source."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(inputs),
        output_names=["out"],
        source=compact(source),
        header=compact(DEVICE_FUNCTIONS),
    )


def layout(k: int, n: int, bits: int) -> tuple[list[tuple[str, int]], int]:
    """The column and warp layout of a product by an [N, K] matrix: the kernel's template
    parameters for it (columns a warp owns, warps a block, warps that split K) and the blocks
    across N."""
    splits = k_splits(k, n, bits)
    return [("CPW", COLUMNS), ("NW", WARPS), ("KS", splits)], -(-n // (WARPS // splits * COLUMNS))


@cache
def _cuda_build() -> bool:
    return mx.cuda.is_available()


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend, on the GPU. (Asked before every
    routed product of an uncompiled step, so the backend's answer is kept.)"""
    return _cuda_build() and mx.default_device() == mx.gpu


def enabled() -> bool:
    """Whether products are routed to the kernel: not turned off (``MLX_DESK_QMV=0``) and able to run."""
    return os.environ.get(ENV, "1") != "0" and available()


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
    (else ``mx.quantized_matmul`` does). Activations, scales and biases share one float
    dtype, so the output's dtype is theirs as MLX's would be."""
    return (
        mode == "affine"
        and has_biases
        and bits in BITS
        and group_size in GROUP_SIZES
        and 1 <= rows <= MAX_ROWS
        and outputs >= 1
        and inputs >= group_size
        and inputs % group_size == 0
        and dtype in DTYPES
        and scales_dtype == dtype
    )


def pays(rows: int, inputs: int, outputs: int) -> bool:
    """Whether a product the kernel can take (``fits``) is faster through it than through
    MLX's own kernel, by the measurements above."""
    if rows == 1:
        return inputs * outputs >= ONE_ROW_MIN_WEIGHTS
    return rows in ROUTED_ROWS


def k_splits(inputs: int, outputs: int, bits: int) -> int:
    """Warps that split the input dimension of one column set (1, 2 or 4 of a block's warps).

    Splitting puts more warps, so more loads, in flight where a matrix has few columns for
    its length (down projections: 2,560 x 9,728); it stops while every lane of a warp still
    has a chunk of 16 bytes and once the grid holds ``TARGET_WARPS``. It depends on the
    matrix only, never on the rows, so a row's sums run in the same order at any row count."""
    chunks = inputs * bits // 128
    column_sets = -(-outputs // COLUMNS)
    splits = 1
    while splits < WARPS and chunks >= 2 * splits * 32 and column_sets * splits < TARGET_WARPS:
        splits *= 2
    return splits


def matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    residual: mx.array | None = None,
) -> mx.array:
    """``x @ dequantize(w).T`` for ``x`` [..., K] and an [N, K] weight packed as MLX packs it
    (``w`` uint32 [N, K * bits / 32], ``scales``/``biases`` [N, K / group_size]), plus
    ``residual`` ([..., N] in x's dtype) where given, as ``residual + product`` computes it.
    The caller checks ``fits``."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    warps, blocks = layout(k, n, bits)
    names, inputs = ("x", "w", "scales", "biases"), [flat, w, scales, biases]
    kernel = rows_kernel("quantized_matmul_rows", names, _SOURCE)
    if residual is not None:
        kernel = rows_kernel("quantized_matmul_rows_plus", (*names, "residual"), _RESIDUAL_SOURCE)
        inputs.append(residual.reshape(rows, n))
    (out,) = kernel(
        inputs=inputs,
        template=[("T", x.dtype), ("R", rows), ("BITS", bits), ("GS", group_size), *warps],
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


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


def _routed(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str
) -> bool:
    """Whether the kernel takes the product of ``x`` by the [N, K] weight ``w``: turned on and
    able to run here, faster than MLX's at this size (``pays``) and one it computes (``takes``)."""
    if w.ndim != 2 or x.ndim < 1 or not enabled():
        return False
    rows = x.size // max(x.shape[-1], 1)
    return pays(rows, x.shape[-1], w.shape[0]) and takes(rows, x, w, scales, biases, group_size, bits, mode)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul(..., transpose=True)``, through the kernel where it is enabled, fits
    and pays; where MLX's kernel keeps the product, a batch's rows reach it as one matrix
    (``_as_one_matrix``)."""
    if _routed(x, w, scales, biases, group_size, bits, mode):
        return matmul(x, w, scales, biases, group_size, bits)
    # MLX's own kernel, with or without ours turned off (``MLX_DESK_QMV=0``).
    if w.ndim == 2 and x.ndim > 2 and x.size // max(x.shape[-1], 1) > x.shape[-2] and available():
        return _as_one_matrix(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )


def residual_enabled() -> bool:
    """Whether a product's residual add may run in the kernel's epilogue: wherever the
    kernel runs, unless turned off (``MLX_DESK_QMV_RESIDUAL=0``; docs/qmv.md)."""
    return os.environ.get(RESIDUAL_ENV, "1") != "0" and enabled()


def quantized_matmul_plus(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    residual: mx.array,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``residual + quantized_matmul(x, w, ...)``: one launch where the kernel takes the product
    and the residual is its output's shape and dtype (a decode step's residual stream), else
    the product and the add as they are."""
    if (
        residual_enabled()
        and _routed(x, w, scales, biases, group_size, bits, mode)
        and residual.shape == (*x.shape[:-1], w.shape[0])
        and residual.dtype == x.dtype
    ):
        return matmul(x, w, scales, biases, group_size, bits, residual=residual)
    return residual + quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)


def _as_one_matrix(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int, mode: str
) -> mx.array:
    """MLX's product of a [B, L, K] input as one [B * L, K] matrix. MLX's CUDA backend runs a
    [B, L, K] input as B products of L rows, each reading the whole weight: a batch step of 8
    streams ([8, 1, K]) read every matrix 8 times. As one matrix of 8 or more rows its tiled
    kernel reads it about once (docs/qmv.md)."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = mx.quantized_matmul(
        x.reshape(-1, k), w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )
    return y.reshape(*lead, y.shape[-1])


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """``layer(x)``, with an ``nn.QuantizedLinear``'s product routed through ``quantized_matmul``
    where MLX's CUDA backend runs. Other layers (plain, adapter hosts, subclasses) and every
    layer elsewhere are called as they are (so wrappers of ``__call__`` still apply)."""
    if type(layer) is not nn.QuantizedLinear or not available():
        return layer(x)
    y = quantized_matmul(x, *_packed(layer), **_quantization(layer))
    return y + layer["bias"] if "bias" in layer else y


def linear_plus(layer: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """``residual + linear(layer, x)``, the add in the kernel's epilogue where an
    ``nn.QuantizedLinear`` without a bias takes the kernel (``quantized_matmul_plus``)."""
    if type(layer) is not nn.QuantizedLinear or "bias" in layer or not available():
        return residual + linear(layer, x)
    return quantized_matmul_plus(x, *_packed(layer), residual, **_quantization(layer))


def embedding_logits(embed: nn.Module, h: mx.array) -> mx.array:
    """``embed.as_linear(h)`` (tied output head), routed like ``linear`` for a quantized embedding."""
    if type(embed) is not nn.QuantizedEmbedding or not available():
        return embed.as_linear(h)
    return quantized_matmul(h, *_packed(embed), **_quantization(embed))


def _packed(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array | None]:
    """A quantized layer's codes, scales and biases (None in modes without them)."""
    return layer["weight"], layer["scales"], layer.get("biases")


def _quantization(layer: nn.Module) -> dict:
    """A quantized layer's group size, bits and mode, as the products take them."""
    return {"group_size": layer.group_size, "bits": layer.bits, "mode": getattr(layer, "mode", "affine")}
