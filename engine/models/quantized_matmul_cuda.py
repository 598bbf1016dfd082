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

Expert products of a decode step go through the same body: models.gathered_matmul_cuda.
"""

from __future__ import annotations

import os
import re
import struct
from functools import cache

import mlx.core as mx

from engine.models.cuda_build import cuda_kernel, launch_bounds

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
# (``MLX_DESK_QMV_FLOAT_MODES=1``) until timed: E2M1 or E4M3 codes, one E8M0 scale a group of
# 32, no biases. NVFP4's groups of 16 would split a lane's chunk of 32 codes; it keeps MLX's.
FLOAT_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32)}
MODE_IDS = {"affine": 0, "mxfp4": 1, "mxfp8": 2}
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
# One logic op a code (``MLX_DESK_QMV_ONE_OP_CODES=1``; off until timed): the compiler spends two
# on ``(word & mask) | magic`` (its LOP3 takes one immediate and both are constants), about 128
# of the 676 instructions of a chunk of the gate/up variant's loop (NVIDIA's compiler, sm_90);
# the inline ``lop3`` takes them as registers, 551 (the tensor-core kernel's loop, which takes the
# switch too: 450 to 386 at one row). The products were measured issuing on 44-63% of cycles
# (docs/qmv.md, "Registers"). The same bits either way.
ONE_OP_ENV = "MLX_DESK_QMV_ONE_OP_CODES"
# Wider warps for products of at most ``WIDE_ROWS`` rows (``MLX_DESK_QMV_COLUMNS=8``; off until
# timed): a lane's activations serve 8 weight rows instead of 4, so the loop spends fewer
# instructions a code on them (3.94 a code and column with one-op codes against 4.32, NVIDIA's
# compiler, sm_90) at 166-168 registers. Only the grid changes: K is split as at 4 columns
# (``k_splits``), so every column's sum runs in the same order and the bits do not change.
COLUMNS_ENV = "MLX_DESK_QMV_COLUMNS"
WIDE_ROWS = 2
# Rows x inputs a block norms into its shared memory (``norm_fits``): 6 rows of qwen3-4b's
# 2,560 values in bfloat16, 4 of llama3-8b's 4,096 (static shared memory stops at 48 KB).
NORM_STAGE_BYTES = 32 << 10

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
#if defined(__CUDA_ARCH__) && defined(ONE_OP_CODES)
    // (word & mask) | magic as one LOP3: written in C++, the compiler keeps both constants as
    // immediates, and a LOP3 takes one, so it spends two logic ops a code.
    uint32_t bits;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(low ? word : high), "r"(CODE << p), "r"(magic));
    out[i] = __int_as_float(bits) - (float)(1u << (23 - p));
#else
    out[i] = __int_as_float(((low ? word : high) & (CODE << p)) | magic) - (float)(1u << (23 - p));
#endif
  }
}

// The codes of one word of a float mode's weights as floats (MODE 1: MXFP4's 8 E2M1 codes;
// MODE 2: MXFP8's 4 E4M3 codes). A code's exponent and mantissa bits go to the bottom of a
// float's exponent and the top of its mantissa, which makes it the code's value times 2^-126
// (E2M1) or 2^-120 (E4M3), subnormal codes included; one multiply scales it back exactly.
template <int MODE>
__device__ __forceinline__ void float_codes(uint32_t word, float* out) {
  constexpr int CB = MODE == 1 ? 4 : 8;  // a code's bits
  constexpr int PW = 32 / CB;
  constexpr uint32_t MAG = (1u << (CB - 1)) - 1u;  // exponent and mantissa bits
  constexpr int AT = MODE == 1 ? 22 : 20;           // where they go in the float
  constexpr float BACK = MODE == 1 ? 0x1p126f : 0x1p120f;
#pragma unroll
  for (int i = 0; i < PW; ++i) {
    const uint32_t code = word >> (i * CB);
    const uint32_t bits = ((code & MAG) << AT) | ((code << (32 - CB)) & 0x80000000u);
    out[i] = __int_as_float(bits) * BACK;
  }
}

// An E8M0 scale (MX modes): 2^(e - 127), 2^-127 for e = 0.
__device__ __forceinline__ float e8m0(uint8_t e) {
  return e ? __int_as_float((uint32_t)e << 23) : __int_as_float(0x00400000);
}

// Codes first..first + N - 1 of a chunk of WORDS words holding its codes end to end, as MLX
// packs 3, 5 and 6 bits (a code may cross into the next word), as floats by the same trick. A
// code whose bits would reach the exponent is taken from its word's high half joined to the next
// word's low half (one funnel shift), which also holds the codes that cross.
template <int BITS, int WORDS, int N>
__device__ __forceinline__ void span_codes(const uint32_t (&q)[WORDS], const int first, float* out) {
  constexpr uint32_t CODE = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int bit = (first + i) * BITS;
    const int j = bit / 32, o = bit % 32;
    const bool low = o + BITS <= 23;
    const uint32_t next = j + 1 < WORDS ? q[j + 1] : 0u;
    const uint32_t word = low ? q[j] : (q[j] >> 16) | (next << 16);
    const int p = low ? o : o - 16;
    out[i] = __int_as_float((word & (CODE << p)) | ((uint32_t)(150 - p) << 23)) - (float)(1u << (23 - p));
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

# The RMSNorm a product's prologue runs (``norm``): the row kernel's and the tensor-core kernel's.
NORM_FUNCTIONS = """
// R rows of x [R, KN] normed as MLX's rms_norm norms them (each row times rsqrt(mean(x^2) +
// eps) rounded to T, then times the norm's weight in T) into ``normed`` (shared memory) by the
// whole block of NW warps. Each thread sums a fixed strided set of a row's squares and the
// warps' sums are added in warp order, so every block norms a row to the same values.
template <typename T, int R, int KN, int NW>
__device__ __forceinline__ void block_norm(const T* x, const T* norm, const float eps, T* normed) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __shared__ float warp_sums[NW];
  for (int r = 0; r < R; ++r) {
    const T* row = x + (long)r * KN;
    float squares = 0.f;
    for (int k = threadIdx.x; k < KN; k += NW * 32) {
      const float v = static_cast<float>(row[k]);
      squares += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
    if (lane == 0) warp_sums[warp] = squares;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NW; ++i) total += warp_sums[i];
    const float scale = rsqrt(total / KN + eps);
    for (int k = threadIdx.x; k < KN; k += NW * 32) {
      const T y = static_cast<T>(static_cast<float>(row[k]) * scale);
      normed[r * KN + k] = static_cast<T>(static_cast<float>(norm[k]) * static_cast<float>(y));
    }
    __syncthreads();  // the sums are read before the next row's overwrite them
  }
}

"""

# The kernels' shared body, a device function: the plain product calls it once per block,
# the gathered one (models.gathered_matmul_cuda) with each (token, expert) pair's pointers.
_PRODUCT = """
// A lane's chunk of a column's codes: one 16-byte load of four words where the width divides
// 32 (4 * 32 / BITS codes), else BITS words of 32 codes end to end (3, 5 and 6 bits: 12, 20 or
// 24 bytes, loaded a word at a time). SEG: codes turned into floats at a time.
template <int BITS>
struct ChunkShape {
  static constexpr bool WHOLE = 32 % BITS == 0;
  static constexpr int WORDS = WHOLE ? 4 : BITS;
  static constexpr int VALUES = WORDS * 32 / BITS;
  static constexpr int SEG = WHOLE ? 32 / BITS : 8;
};

// One chunk of codes of each of a warp's CPW columns, with the column's scale and bias for the
// chunk's quantization group: what a lane loads before it multiplies.
template <int CPW, int WORDS = 4>
struct Chunk {
  uint32_t q[CPW][WORDS];
  float s[CPW], b[CPW];
};

// Chunk c of the columns whose packed rows start at words wrow and groups srow (MODE > 0: a
// float mode's, E8M0 scales and no biases).
template <typename T, int BITS, int GS, int MODE, typename SC, int CPW, int WORDS>
__device__ __forceinline__ void load_chunk(Chunk<CPW, WORDS>& chunk, const uint32_t* w, const SC* scales,
                                           const T* biases, const long (&wrow)[CPW], const long (&srow)[CPW],
                                           const int c, const bool w_aligned) {
  const int group = (c * ChunkShape<BITS>::VALUES) / GS;
#pragma unroll
  for (int j = 0; j < CPW; ++j) {
    const uint32_t* src = w + wrow[j] + (long)c * WORDS;
    if constexpr (!ChunkShape<BITS>::WHOLE) {
#pragma unroll
      for (int t = 0; t < WORDS; ++t) chunk.q[j][t] = src[t];
    } else if (w_aligned) {
      const uint4 u = *reinterpret_cast<const uint4*>(src);
      chunk.q[j][0] = u.x; chunk.q[j][1] = u.y; chunk.q[j][2] = u.z; chunk.q[j][3] = u.w;
    } else {
#pragma unroll
      for (int t = 0; t < 4; ++t) chunk.q[j][t] = src[t];
    }
    if constexpr (MODE == 0) {
      chunk.s[j] = static_cast<float>(scales[srow[j] + group]);
      chunk.b[j] = static_cast<float>(biases[srow[j] + group]);
    } else {
      chunk.s[j] = e8m0(scales[srow[j] + group]);
      chunk.b[j] = 0.f;
    }
  }
}

// acc[r][j] += the chunk's share of row r of x [R, K] times column j. The chunk lies in one
// quantization group, so its sum is scale * (x . codes) + bias * sum(x) per row and column:
// the codes are multiplied into the rows as they are, and each column's scale and bias are
// applied once a chunk.
template <typename T, int R, int BITS, int MODE, int CPW, int WORDS>
__device__ __forceinline__ void add_chunk(const Chunk<CPW, WORDS>& chunk, const T* x, const int K, const int c,
                                          const bool x_aligned, float (&acc)[R][CPW]) {
  constexpr int PW = ChunkShape<BITS>::SEG;  // codes a step: a word's where the width divides 32
  constexpr int VPL = ChunkShape<BITS>::VALUES;
  float dot[R][CPW], xsum[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    xsum[r] = 0.f;
#pragma unroll
    for (int j = 0; j < CPW; ++j) dot[r][j] = 0.f;
  }
#pragma unroll
  for (int t = 0; t < VPL / PW; ++t) {
    float codes[CPW][PW];
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
      if constexpr (MODE > 0) {
        float_codes<MODE>(chunk.q[j][t], codes[j]);
      } else if constexpr (ChunkShape<BITS>::WHOLE) {
        word_codes<BITS>(chunk.q[j][t], codes[j]);
      } else {
        span_codes<BITS, WORDS, PW>(chunk.q[j], t * PW, codes[j]);
      }
    }
    const int k = c * VPL + t * PW;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xf[PW];
      load_floats<T, PW>(x + (long)r * K + k, xf, x_aligned);
      if constexpr (MODE == 0) {  // the float modes have no biases
#pragma unroll
        for (int i = 0; i < PW; ++i) xsum[r] += xf[i];
      }
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
    for (int j = 0; j < CPW; ++j) {
      if constexpr (MODE == 0) {
        acc[r][j] += fmaf(chunk.s[j], dot[r][j], chunk.b[j] * xsum[r]);
      } else {
        acc[r][j] += chunk.s[j] * dot[r][j];
      }
    }
  }
}

// out[r, n] = sum_k x[r, k] * dequantize(w)[n, k] for R rows of x [R, K] and one [N, K]
// weight packed as MLX packs it, for the column sets of this block (blockIdx.x), or for
// this warp's column set ``set`` where given (every warp of the block calling it alike when
// KS > 1, and meeting at __syncthreads before the next call reuses the shared sums; no norm).
// T: activations, scales, biases and output; R: rows; BITS; GS: group size; CPW: columns
// per warp; NW: warps per block; KS: warps splitting K for one column set; RES: whether
// residual [R, N] is added to the output (rounded to T first, then added in float32 and
// rounded again: what the product and a separate add compute). GLU: the weight stacks gate
// rows over up rows ([2I, K]), a warp's first CPW / 2 columns are gate rows and the rest the
// up rows of the same outputs, and out [R, I] is gate * SIG(gate) * up with every op in T,
// as MLX's elementwise kernels compute silu(gate) * up from the rounded product (SIG: MLX's
// own Sigmoid functor). KN > 0: x is first normed (``block_norm``) into shared memory by the
// whole block, and the product reads that (KN = K). MODE: 0 affine; 1 MXFP4 and 2 MXFP8, whose
// scales SC are E8M0 bytes and which have no biases (``biases`` unread).
template <typename T, int R, int BITS, int GS, int CPW, int NW, int KS, bool RES = false, bool GLU = false,
          typename SIG = float, int KN = 0, int MODE = 0, typename SC = T>
__device__ __forceinline__ void rows_product(
    const T* x, const uint32_t* w, const SC* scales, const T* biases, T* out, const int K, const int N,
    const T* residual = nullptr, const T* norm = nullptr, const float eps = 0.f, const int set = -1) {
  constexpr int WORDS = ChunkShape<BITS>::WORDS;   // words a lane's chunk of a column
  constexpr int VPL = ChunkShape<BITS>::VALUES;   // values a lane's chunk
  constexpr int CG = NW / KS;          // column sets per block; KS warps share each one
  constexpr int OPW = GLU ? CPW / 2 : CPW;  // output columns per warp
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int part = warp % KS;          // this warp's strips of K: chunks part*32 + 32*KS*i
  const int col0 = (set >= 0 ? set : blockIdx.x * CG + warp / KS) * OPW;
  const int outputs = GLU ? N / 2 : N;
  const int chunks = K / VPL;          // K is a multiple of the group size, so of VPL
  const int words_per_row = K / VPL * WORDS;
  const int groups_per_row = K / GS;
  __shared__ __align__(16) T normed[KN > 0 ? R * KN : 1];
  if constexpr (KN > 0) {
    block_norm<T, R, KN, NW>(x, norm, eps, normed);
    x = normed;
  }
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;
  const bool w_aligned = (reinterpret_cast<unsigned long long>(w) & 15ull) == 0;

  // Columns past the outputs repeat the last one (valid memory) and are never written: every
  // warp runs to the end, since the block meets at a barrier when KS > 1.
  long wrow[CPW], srow[CPW];
#pragma unroll
  for (int j = 0; j < CPW; ++j) {
    const bool up = GLU && j >= OPW;
    const int n = min(col0 + (up ? j - OPW : j), outputs - 1) + (up ? outputs : 0);
    wrow[j] = (long)n * words_per_row;
    srow[j] = (long)n * groups_per_row;
  }

  float acc[R][CPW];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < CPW; ++j) acc[r][j] = 0.f;
  }

  int c = part * 32 + lane;
  const int stride = KS * 32;
#ifdef CHUNK_PREFETCH
  // Each chunk's loads issue before the chunk ahead of it is multiplied, so a lane's memory
  // round trips overlap its arithmetic instead of following it (the sums run as below).
  Chunk<CPW, WORDS> next;
  if (c < chunks) load_chunk<T, BITS, GS, MODE>(next, w, scales, biases, wrow, srow, c, w_aligned);
  for (; c < chunks; c += stride) {
    const Chunk<CPW, WORDS> chunk = next;
    if (c + stride < chunks) load_chunk<T, BITS, GS, MODE>(next, w, scales, biases, wrow, srow, c + stride, w_aligned);
    add_chunk<T, R, BITS, MODE>(chunk, x, K, c, x_aligned, acc);
  }
#else
#ifdef CHUNK_UNROLL
#pragma unroll CHUNK_UNROLL_COUNT
#endif
  for (; c < chunks; c += stride) {
    Chunk<CPW, WORDS> chunk;
    load_chunk<T, BITS, GS, MODE>(chunk, w, scales, biases, wrow, srow, c, w_aligned);
    add_chunk<T, R, BITS, MODE>(chunk, x, K, c, x_aligned, acc);
  }
#endif

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
      for (int j = 0; j < OPW; ++j) {
        if (col0 + j >= outputs) continue;
        const long o = (long)r * outputs + col0 + j;
        if constexpr (GLU) {
          const T gate = static_cast<T>(acc[r][j]);
          out[o] = (gate * SIG{}(gate)) * static_cast<T>(acc[r][j + OPW]);
        } else if constexpr (RES) {
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
DEVICE_FUNCTIONS = _HEADER + NORM_FUNCTIONS + _PRODUCT


def kernel_source(residual: bool = False, glu: bool = False, norm: bool = False, mode: str = "affine") -> str:
    """The kernel's body: ``rows_product`` with template constants as its own (runtime: K from
    the packed weight's width, w_shape[1] words of 32 / BITS codes, so x's shape need not reach
    the kernel whatever its leading axes; N is w_shape[0]), plus ``residual`` added to the
    output, ``glu`` (silu(gate) * up from a stacked gate/up weight, with MLX's own Sigmoid, which ``GLU_HEADER`` includes) and
    ``norm`` (x normed first by the weight ``norm`` and the epsilon whose float bits are EPS).
    A float ``mode`` (``FLOAT_MODES``) reads E8M0 scales and no biases."""
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
    if os.environ.get(PREFETCH_ENV, "0") == "1":
        return "#define CHUNK_PREFETCH\n"
    value = os.environ.get(UNROLL_ENV, "")
    if not (value.isdigit() and 2 <= int(value) <= 8):
        return ""
    # A constant, not a macro: ``#pragma unroll`` takes a constant expression and does not
    # expand macros in it.
    return f"#define CHUNK_UNROLL\nconstexpr int CHUNK_UNROLL_COUNT = {int(value)};\n"


def bounds() -> str:
    """The launch bounds' header line (``MLX_DESK_QMV_BOUNDS``), or nothing."""
    value = os.environ.get(BOUNDS_ENV, "")
    if not (value.isdigit() and int(value) <= 32):
        return ""
    return launch_bounds(WARPS * 32, int(value))


def one_op_codes() -> str:
    """The ``#define`` that unpacks each code with one logic op (``MLX_DESK_QMV_ONE_OP_CODES=1``), or nothing."""
    return "#define ONE_OP_CODES\n" if os.environ.get(ONE_OP_ENV, "0") == "1" else ""


def columns(rows: int) -> int:
    """Columns a warp owns for a product of ``rows`` rows: 8 up to ``WIDE_ROWS`` rows where
    ``MLX_DESK_QMV_COLUMNS=8`` asks for it, else ``COLUMNS``."""
    wide = os.environ.get(COLUMNS_ENV, "") == "8" and rows <= WIDE_ROWS
    return 2 * COLUMNS if wide else COLUMNS


def build_switches() -> str:
    """The product's build switches as its header's first lines: how a lane walks its chunks,
    launch bounds, how a code is unpacked."""
    return chunk_loop() + bounds() + one_op_codes()


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
    (else ``mx.quantized_matmul`` does). Affine activations, scales and biases share one float
    dtype, so the output's dtype is theirs as MLX's would be; a float mode's scales are E8M0
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
        and group_size % chunk_values(bits) == 0  # a lane's chunk of codes lies in one group
        and 1 <= rows <= ROW_LIMITS.get(bits, MAX_ROWS)
        and outputs >= 1
        and inputs >= group_size
        and inputs % group_size == 0
        and dtype in DTYPES
    )


def float_modes_on() -> bool:
    """Whether float-mode products are routed to the kernel (``MLX_DESK_QMV_FLOAT_MODES=1``)."""
    return os.environ.get(FLOAT_MODES_ENV, "0") == "1"


def routed_bits() -> tuple[int, ...]:
    """The code widths products are routed to the kernel for: ``BITS``, and 2, 3, 5 and 6 with
    ``MLX_DESK_QMV_OTHER_BITS=1``."""
    return BITS + (UNTIMED_BITS if os.environ.get(OTHER_BITS_ENV, "0") == "1" else ())


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
    float ``mode`` takes its E8M0 scales and no biases. The caller checks ``fits``."""
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
    includes = build_switches() + (GLU_HEADER if glu else "")
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
