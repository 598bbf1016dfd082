"""The small-row kernel's device code (models.quantized_matmul_cuda builds its kernels on it,
and the tensor-core kernel takes its norm): how a word's codes become floats for each width and
float mode, the activations' loads, the prologue's RMSNorm, and ``rows_product``, the body that
walks a lane's chunks of K, multiplies them into the rows and writes the epilogue. C++ for
``mx.fast.cuda_kernel``; the CPU emulation in the tests builds the same text with g++.
"""

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

// The codes of one word of a float mode's weights as floats (MODE 1 and 3: MXFP4's and
// NVFP4's 8 E2M1 codes; MODE 2: MXFP8's 4 E4M3 codes). A code's exponent and mantissa bits go
// to the bottom of a float's exponent and the top of its mantissa, which makes it the code's
// value times 2^-126 (E2M1) or 2^-120 (E4M3), subnormal codes included; one multiply scales it
// back exactly.
template <int MODE>
__device__ __forceinline__ void float_codes(uint32_t word, float* out) {
  constexpr int CB = MODE == 2 ? 8 : 4;  // a code's bits
  constexpr int PW = 32 / CB;
  constexpr uint32_t MAG = (1u << (CB - 1)) - 1u;  // exponent and mantissa bits
  constexpr int AT = MODE == 2 ? 20 : 22;           // where they go in the float
#pragma unroll
  for (int i = 0; i < PW; ++i) {
    const uint32_t code = word >> (i * CB);
    const uint32_t bits = ((code & MAG) << AT) | ((code << (32 - CB)) & 0x80000000u);
    out[i] = __int_as_float(bits) * (MODE == 2 ? 0x1p120f : 0x1p126f);
  }
}

// An E4M3 scale byte's value (NVFP4), by float_codes's trick.
__device__ __forceinline__ float e4m3(uint8_t e) {
  return __int_as_float(((uint32_t)(e & 0x7Fu) << 20) | ((uint32_t)(e & 0x80u) << 24)) * 0x1p120f;
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
    } else if constexpr (MODE == 3) {  // NVFP4: a chunk is two groups, s the first's, b the second's
      chunk.s[j] = e4m3(scales[srow[j] + group]);
      chunk.b[j] = e4m3(scales[srow[j] + group + 1]);
    } else {
      chunk.s[j] = e8m0(scales[srow[j] + group]);
      chunk.b[j] = 0.f;
    }
  }
}

// acc[r][j] += the chunk's share of row r of x [R, K] times column j. The chunk lies in one
// quantization group, so its sum is scale * (x . codes) + bias * sum(x) per row and column:
// the codes are multiplied into the rows as they are, and each column's scale and bias are
// applied once a chunk (NVFP4's chunk is two groups: each half's scale once a half).
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
    if constexpr (MODE == 3) {
      if (t == VPL / PW / 2 - 1) {  // NVFP4: the chunk's first group is summed; its scale is s
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int j = 0; j < CPW; ++j) {
            acc[r][j] += chunk.s[j] * dot[r][j];
            dot[r][j] = 0.f;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
      if constexpr (MODE == 0) {
        acc[r][j] += fmaf(chunk.s[j], dot[r][j], chunk.b[j] * xsum[r]);
      } else if constexpr (MODE == 3) {  // the second group's
        acc[r][j] += chunk.b[j] * dot[r][j];
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
// scales SC are E8M0 bytes, and 3 NVFP4, whose are E4M3 bytes, a group of 16 codes each; the
// float modes have no biases (``biases`` unread).
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

  int c = part * 32 + lane;
  const int stride = KS * 32;
#if defined(EARLY_LOAD) && !defined(CHUNK_PREFETCH)
  // A lane's first chunk is asked of memory before the block norms its rows, so the weights'
  // round trip runs under the norm's instead of after it (a product of a short K is one or
  // two chunks a lane: its grid is one wave, every warp norming, then loading, in step).
  Chunk<CPW, WORDS> first;
  if (KN > 0 && c < chunks) load_chunk<T, BITS, GS, MODE>(first, w, scales, biases, wrow, srow, c, w_aligned);
#endif
  __shared__ __align__(16) T normed[KN > 0 ? R * KN : 1];
  if constexpr (KN > 0) {
    block_norm<T, R, KN, NW>(x, norm, eps, normed);
    x = normed;
  }
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;

  float acc[R][CPW];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < CPW; ++j) acc[r][j] = 0.f;
  }
#if defined(EARLY_LOAD) && !defined(CHUNK_PREFETCH)
  if (KN > 0 && c < chunks) {  // the same chunks in the same order: the same sums
    add_chunk<T, R, BITS, MODE>(first, x, K, c, x_aligned, acc);
    c += stride;
  }
#endif
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
