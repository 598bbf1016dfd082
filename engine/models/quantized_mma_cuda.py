"""Quantized matrix products of up to 16 rows on the GPU's tensor cores, for 4-bit affine
weights and half-precision activations: a cost that stays about one weight read from one row
to sixteen.

models.quantized_matmul_cuda multiplies each dequantized code into every row with its own
float instruction, so its cost grows with the rows (an H200: qwen3-4b's gate+up 36 us at one
row, 67 at eight; docs/qmv.md). Here a warp owns 16 output columns (weight rows) and feeds
their codes to ``mma.sync.m16n8k16`` as the MMA's A operand, the activations' rows (8 per
tile, two tiles for 9-16 rows) as its B operand: one instruction does 16 x 8 x 16
multiply-adds, so a code costs its conversion to a half float (``codes_pair``: a logic op and
one fused multiply-add for two codes, exact; the compiler makes the logic op two unless
``MLX_DESK_QMV_ONE_OP_CODES=1``), whatever the rows.

Groups stay exact: MLX's product is ``scale * (x . q) + bias * sum(x)`` per quantization
group, in float32. Each MMA k-step takes its 16 codes from one group (a lane quad's four
lanes load one group's codes of a weight row: 8 codes a lane per word, ``GS / 32`` words),
the codes' MMA sums a group into a float32 accumulator of its own, and a second MMA with an
A of ones sums the same x values (``sum(x)`` of each row, in the accumulator's layout). After
the group both meet the column's scale and bias in float32. The MMA's products of halves are
exact in float32, so outputs equal MLX's to float rounding (the sums' order differs).

Which k a lane's MMA slots hold is free as long as A and B agree: a lane's word holds codes
c0..c7 of 8 consecutive k, and ``(w & 0x000F000F)`` puts c0 and c4 in the two halves of a
register, so the lane's slots take (c0, c4), (c1, c5) in one k-step and (c2, c6), (c3, c7)
in the next; its activations (8 consecutive values, one 16-byte load) are paired the same
way with one byte permutation a register.

Each iteration a lane loads 8 words of each of its two weight rows (256 codes of K a row
across the quad) and their activations before any MMA, so a warp keeps 2 KB of weights in
flight; ``KS`` warps of a block split K where the columns are few (down projections).

As the row kernel, it takes a product's residual add (``residual``) or a gated MLP's
``silu(gate) * up`` (``glu``: a tile's 16 A rows are 8 gate rows and their 8 up rows, so a
lane holds both sums of an output) into its epilogue, and the RMSNorm before the product into
its prologue (``norm``, the row kernel's ``block_norm``: each block norms the rows into shared
memory). The norm joins it only for rows outside its own 8-16 (models.quantized_routing).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_cuda import (
    GLU_HEADER,
    compact,
    enabled,
    epilogue_flags,
    float_bits,
    one_op_codes,
    variant_suffix,
)
from engine.models.quantized_matmul_cuda import fits as row_kernel_fits
from engine.models.quantized_matmul_cuda import takes as row_kernel_takes
from engine.models.quantized_matmul_device import NORM_FUNCTIONS

# Warps per block, and warps to aim for across the grid when splitting K (as the row kernel).
WARPS = 8
TARGET_WARPS = 4096
DTYPES = (mx.float16, mx.bfloat16)
# Codes of K each lane quad covers an iteration: 8 words of 8 codes a lane (``U`` groups).
ITERATION = 256
# On by default: 8 and 16 streams decoded 1.14-1.64x faster through it (docs/qmv.md, "Tensor
# cores for 8-16 rows"); ``MLX_DESK_QMV_MMA=0`` turns it off.
ENV = "MLX_DESK_QMV_MMA"

# The kernel's only inline assembly, in functions the CPU emulation of the tests replaces.
PRIMITIVES = r"""
// c += A (16 x 16, this lane's 4 registers of half pairs) x B (16 x 8, 2 registers), float32.
template <bool BF>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// The 4-bit codes at bits 0-3 and 16-19 of w as a pair of halves, exactly: the code under the
// exponent of 128 (bf16) or 1024 (f16), then that number taken away by one fused multiply-add.
template <bool BF>
__device__ __forceinline__ uint32_t codes_pair(uint32_t w) {
#ifdef ONE_OP_CODES
  // One LOP3 with both constants as registers (in C++ the compiler spends two: models.quantized_matmul_cuda).
  uint32_t h;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w), "r"(0x000F000Fu), "r"(BF ? 0x43004300u : 0x64006400u));
#else
  const uint32_t h = (w & 0x000F000Fu) | (BF ? 0x43004300u : 0x64006400u);
#endif
  uint32_t r;
  if constexpr (BF) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(h), "r"(0x3F803F80u), "r"(0xC300C300u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(h), "r"(0x3C003C00u), "r"(0xE400E400u));
  }
  return r;
}
"""

_PRODUCT = r"""
// out[r, n] = sum_k x[r, k] * dequantize(w)[n, k] for R <= 16 rows of x [R, K] (T: half or
// bfloat16, BF says which) and one [N, K] weight of 4-bit codes packed as MLX packs them,
// groups of GS; NW warps a block, KS of them splitting K for one tile of 16 columns. RES:
// residual [R, N] is added to the output (the product rounded to T, added in float32, rounded
// again: what the product and a separate add compute). GLU: the weight stacks gate rows over
// up rows ([2I, K]); a tile's first 8 columns are gate rows, its last 8 the up rows of the
// same outputs, and out [R, I] is gate * SIG(gate) * up with every op in T, as MLX's
// elementwise kernels compute silu(gate) * up (SIG: MLX's own Sigmoid functor). KN > 0: x is
// first normed by the whole block into shared memory (``block_norm``, the row kernel's), and
// the product reads that (KN = K).
template <typename T, bool BF, int R, int GS, int NW, int KS, bool RES = false, bool GLU = false, typename SIG = float,
          int KN = 0>
__device__ __forceinline__ void mma_rows_product(
    const T* x, const uint32_t* w, const T* scales, const T* biases, T* out, const int K, const int N,
    const T* residual = nullptr, const T* norm = nullptr, const float eps = 0.f) {
  __shared__ __align__(16) T normed[KN > 0 ? R * KN : 1];
  if constexpr (KN > 0) {
    block_norm<T, R, KN, NW>(x, norm, eps, normed);
    x = normed;
  }
  constexpr int NT = (R + 7) / 8;  // tiles of 8 rows: the MMA's N
  constexpr int VEC = GS / 32;     // words a lane loads of a row's group
  constexpr int U = 256 / GS;      // groups an iteration: 8 words a row a lane
  constexpr int TILES = NW / KS;
  constexpr uint32_t ONE = BF ? 0x3F803F80u : 0x3C003C00u;
  const uint32_t ones[4] = {ONE, ONE, ONE, ONE};
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragments' group and thread in group
  const int part = warp % KS;
  const int tile = blockIdx.x * TILES + warp / KS;
  const int groups = K / GS;
  // A tile's outputs: 16 columns, or 8 gate/up pairs. Columns past the outputs repeat the
  // last one (valid memory) and are never written.
  const int outputs = GLU ? N / 2 : N, col0 = tile * (GLU ? 8 : 16);
  const int col_a = min(col0 + g, outputs - 1), col_b = GLU ? col_a + outputs : min(col0 + g + 8, N - 1);
  const uint32_t* wa = w + (long)col_a * (K / 8) + t * VEC;
  const uint32_t* wb = w + (long)col_b * (K / 8) + t * VEC;
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;
  const bool w_aligned = (reinterpret_cast<unsigned long long>(w) & 15ull) == 0;

  float total[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) total[nt][i] = 0.f;
  }
  for (int first = part * U; first < groups; first += KS * U) {
    // Every load of the iteration first, so they are in flight together.
    uint32_t qa[U][VEC], qb[U][VEC], xv[NT][U][VEC][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = first + u < groups;
      const long at = (long)(first + u) * (GS / 8);
      if (in) {
        load_words<VEC>(wa + at, w_aligned, qa[u]);
        load_words<VEC>(wb + at, w_aligned, qb[u]);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) qa[u][v] = qb[u][v] = 0u;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = nt * 8 + g;
#pragma unroll
        for (int v = 0; v < VEC; ++v)
          load_halves(x + (long)r * K + (first + u) * GS + (t * VEC + v) * 8, in && r < R, x_aligned, xv[nt][u][v]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int group = first + u;
      if (group >= groups) break;
      float acc[NT][4], sums[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = sums[nt][i] = 0.f;
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k-steps of codes (0, 4), (1, 5), then (2, 6), (3, 7)
          const uint32_t sa = qa[u][v] >> (8 * h), sb = qb[u][v] >> (8 * h);
          const uint32_t a[4] = {codes_pair<BF>(sa), codes_pair<BF>(sb), codes_pair<BF>(sa >> 4), codes_pair<BF>(sb >> 4)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t lo = xv[nt][u][v][h], hi = xv[nt][u][v][h + 2];
            const uint32_t b0 = __byte_perm(lo, hi, 0x5410), b1 = __byte_perm(lo, hi, 0x7632);
            mma_16816<BF>(acc[nt], a, b0, b1);
            mma_16816<BF>(sums[nt], ones, b0, b1);
          }
        }
      }
      const float s_a = static_cast<float>(scales[(long)col_a * groups + group]);
      const float s_b = static_cast<float>(scales[(long)col_b * groups + group]);
      const float b_a = static_cast<float>(biases[(long)col_a * groups + group]);
      const float b_b = static_cast<float>(biases[(long)col_b * groups + group]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        total[nt][0] += s_a * acc[nt][0] + b_a * sums[nt][0];
        total[nt][1] += s_a * acc[nt][1] + b_a * sums[nt][1];
        total[nt][2] += s_b * acc[nt][2] + b_b * sums[nt][2];
        total[nt][3] += s_b * acc[nt][3] + b_b * sums[nt][3];
      }
    }
  }
  if constexpr (KS > 1) {  // the K-splits' sums meet in shared memory, added in split order
    __shared__ float partial[NW][NT * 4][32];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][nt * 4 + i][lane] = total[nt][i];
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int p = 0; p < KS; ++p) sum += partial[warp + p][nt * 4 + i][lane];
        total[nt][i] = sum;
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < (GLU ? 2 : 4); ++i) {
      const int r = nt * 8 + 2 * t + (i & 1), n = col0 + g + (i >= 2 ? 8 : 0);
      if (r >= R || n >= outputs) continue;
      const long o = (long)r * outputs + n;
      if constexpr (GLU) {  // this lane holds the gate (i) and the up (i + 2) of output n
        const T gate = static_cast<T>(total[nt][i]);
        out[o] = (gate * SIG{}(gate)) * static_cast<T>(total[nt][i + 2]);
      } else if constexpr (RES) {
        out[o] = static_cast<T>(static_cast<float>(residual[o]) + static_cast<float>(static_cast<T>(total[nt][i])));
      } else {
        out[o] = static_cast<T>(total[nt][i]);
      }
    }
  }
}
"""

_LOADS = r"""
// VEC consecutive words at p: one 8- or 16-byte load where aligned.
template <int VEC>
__device__ __forceinline__ void load_words(const uint32_t* p, bool aligned, uint32_t (&r)[VEC]) {
  if constexpr (VEC == 4) {
    if (aligned) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      r[0] = u.x, r[1] = u.y, r[2] = u.z, r[3] = u.w;
      return;
    }
  } else if constexpr (VEC == 2) {
    if (aligned) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      r[0] = u.x, r[1] = u.y;
      return;
    }
  }
  for (int v = 0; v < VEC; ++v) r[v] = p[v];
}
// Eight consecutive halves at p as four registers of pairs (zeros where not ``in``).
template <typename T>
__device__ __forceinline__ void load_halves(const T* p, bool in, bool aligned, uint32_t (&r)[4]) {
  if (!in) {
    r[0] = r[1] = r[2] = r[3] = 0u;
  } else if (aligned) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    r[0] = u.x, r[1] = u.y, r[2] = u.z, r[3] = u.w;
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    for (int i = 0; i < 4; ++i) r[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
  }
}
"""

# The device code the kernel is built on, less the primitives (``PRIMITIVES``).
DEVICE_FUNCTIONS = _LOADS + NORM_FUNCTIONS + _PRODUCT


def kernel_source(residual: bool = False, glu: bool = False, norm: bool = False) -> str:
    """The kernel's body: ``mma_rows_product`` with its template constants, plus ``residual``
    added to the output or ``glu`` (silu(gate) * up of a stacked gate/up weight, with MLX's own
    Sigmoid, which ``GLU_HEADER`` includes), and ``norm`` (x normed first by the weight ``norm``
    and the epsilon whose float bits are EPS)."""
    flags = f"{epilogue_flags(residual, glu)}, {'KN' if norm else 0}"
    tail = ", residual" if residual else ", nullptr"
    tail += ", norm, __int_as_float(EPS)" if norm else ""
    return f"mma_rows_product<T, BF, R, GS, NW, KS, {flags}>(x, w, scales, biases, out, w_shape[1] * 8, w_shape[0]{tail});\n"


SOURCE = kernel_source()


@cache
def _kernel(residual: bool = False, glu: bool = False, switches: str = "", norm: bool = False):
    """The kernel's build for its prologue, its epilogue and ``switches`` (``#define`` lines; a
    build each)."""
    return cuda_kernel(
        name=f"quantized_matmul_mma{variant_suffix(residual, glu, norm)}",
        input_names=["x", "w", "scales", "biases", *(["residual"] if residual else []), *(["norm"] if norm else [])],
        output_names=["out"],
        source=compact(kernel_source(residual, glu, norm)),
        header=switches + (GLU_HEADER if glu else "") + compact(PRIMITIVES + DEVICE_FUNCTIONS),
    )


def k_splits(inputs: int, outputs: int, group_size: int) -> int:
    """Warps of a block that split K for one tile of 16 columns (1 to ``WARPS``): more where
    the tiles are few for the matrix's length, while each split keeps two iterations and the
    grid stays under ``TARGET_WARPS``. It depends on the matrix only, never on the rows."""
    iterations = -(-(inputs // group_size) // (ITERATION // group_size))
    tiles = -(-outputs // 16)
    splits = 1
    while splits < WARPS and iterations >= 2 * splits and tiles * splits < TARGET_WARPS:
        splits *= 2
    return splits


def fits(rows: int, inputs: int, outputs: int, *, bits: int, dtype: mx.Dtype, **rest) -> bool:
    """Whether the kernel takes a product of ``rows`` rows by an [outputs, inputs] weight: one
    the row kernel takes (``quantized_matmul_cuda.fits``, the same arguments), of affine 4-bit
    codes and half-precision activations."""
    return (
        bits == 4
        and rest.get("mode") == "affine"
        and dtype in DTYPES
        and row_kernel_fits(rows, inputs, outputs, bits=bits, dtype=dtype, **rest)
    )


def takes(rows: int, x: mx.array, w: mx.array, *packed_and_quantization) -> bool:
    """Whether the kernel takes ``rows`` rows of ``x`` by the packed weight ``w`` (the arguments
    of ``quantized_matmul_cuda.takes``): one the row kernel takes, of 4-bit codes and half
    precision activations (``fits``)."""
    bits, mode = packed_and_quantization[3:5]
    return (
        bits == 4 and mode == "affine" and x.dtype in DTYPES and row_kernel_takes(rows, x, w, *packed_and_quantization)
    )


def switched_on() -> bool:
    """Whether products of 8-16 rows are routed here: the small-row kernel is (``enabled``)
    and this one is not turned off (``MLX_DESK_QMV_MMA=0``)."""
    return switch(ENV, "1") != "0" and enabled()


def matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int = 4,
    residual: mx.array | None = None,
    glu: bool = False,
    norm: tuple[mx.array, float] | None = None,
) -> mx.array:
    """``x @ dequantize(w).T`` for ``x`` [..., K] (``fits`` rows) and an [N, K] 4-bit weight
    packed as MLX packs it (``bits`` 4, as ``fits`` checks), on the tensor cores; plus
    ``residual`` ([..., N] in x's dtype) where given, or with ``glu`` (the weight stacking gate
    rows over up rows) ``silu(gate) * up`` ([..., N / 2]), and with ``norm`` (weight, eps) the
    product of ``mx.fast.rms_norm(x, weight, eps)``, as the row kernel's ``matmul`` (its
    ``norm_fits`` says for which rows)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    outputs = n // 2 if glu else n
    rows = x.size // max(k, 1)  # x and the residual go in as they are (the row kernel's note)
    splits = k_splits(k, n, group_size)
    tiles = -(-outputs // (8 if glu else 16))  # WARPS // splits of them a block
    blocks = -(-tiles // (WARPS // splits))
    inputs = [x, w, scales, biases, *([residual] if residual is not None else [])]
    constants = []
    if norm is not None:
        inputs.append(norm[0])
        constants = [("KN", k), ("EPS", float_bits(norm[1]))]
    # Two ops a code unless asked: its 8-16 rows were timed that way (docs/qmv.md).
    (out,) = _kernel(residual is not None, glu, one_op_codes(default="0"), norm is not None)(
        inputs=inputs,
        template=[
            ("T", x.dtype),
            ("BF", x.dtype == mx.bfloat16),
            ("R", rows),
            ("GS", group_size),
            ("NW", WARPS),
            ("KS", splits),
            *constants,
        ],
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*lead, outputs)],
        output_dtypes=[x.dtype],
    )
    return out
