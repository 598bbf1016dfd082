"""Attention over a quantized KV cache in two fused CUDA kernels, for decode steps and
verify passes (a few queries over a long cache).

Without it a CUDA decode step dequantized the whole cache to full precision every step and
then ran the fast attention kernel on that copy: the cache was read as codes, written out
at full precision and read again, and a 32k-token chat decoded at a third of the speed of a
full-precision cache (48 tok/s at 8 bits, 59 at 4 bits, against 181, qwen3-4b on an H200).
Here the codes are read once, dequantized in registers and never written back: 93-143 tok/s
at 8 bits and 100 at 4 bits against 193 (the rest of the gap is mostly the cache write,
a quantize and six slice updates a layer, ~1.9 ms a token).

The work is split-K ("flash decoding"): the first kernel gives each block one KV head and
one slice of the cached tokens; each lane group of its warps walks a share of the slice a
few keys at a time, lanes across the head dimension, keeping an online softmax (running
maximum, sum and weighted values) for every query row that reads this KV head (the grouped
query heads times the queries of the pass). The block's lane groups merge in shared memory
and write one partial result per slice; the second kernel merges the slices. Exponentials are base 2 with
the scale folded in, as the fast attention kernels do.

Only plain causal attention is fused: no mask (one query) or the "causal" string (the last
L positions see keys up to their own). Array masks (windows, batch padding), sinks and soft
caps keep the dequantizing path. ``fits`` says which shapes the kernel takes.
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

from engine.models.cuda_build import cuda_kernel

# Warps per block. Each warp splits into lane groups of LPK lanes (``_lanes_per_key``), each
# group on its own key: fewer lanes per key means fewer shuffles to sum a dot product (the
# first kernel, a whole warp per key, spent its time there: 5.2 ms a token over 36 layers at
# 32k where the fast full-precision kernel takes 1.6 ms).
WARPS = 4
# Floats a lane may hold per query row, and registers for the keys it loads ahead (as
# codes: dequantized at use, so 4x as many keys are in flight as holding floats would allow).
LANE_ROW_FLOATS = 64
LANE_LOAD_REGS = 48
# Blocks to aim for across all KV heads: two per streaming multiprocessor of an H200 (132).
# At 32k tokens, 264 was as fast as or faster than 528 and 1,056 (more, smaller slices
# cost more in partial results than they gain in warps waiting on memory).
TARGET_BLOCKS = 264
# Fewest keys per slice: below this the partial results cost more than the slice's work.
MIN_SLICE = 64
# Query rows a block takes (grouped heads times the pass's queries; more are split across
# blocks): their running sums stay in registers at 16 lanes a key for a head of 128, and
# in shared memory for the merge (32 KB a block at most).
ROWS_PER_BLOCK = 8

_HEADER = """
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Key j's scores s[r] (scaled for base 2) and values vf join each query row's running softmax
// (maximum m, sum s_sum, weighted values acc); past the slice, or after a row's own position
// (causal: query l of L sees keys up to its own), the key is left out.
template <int RB, int DPL, int L>
__device__ __forceinline__ void online_softmax(const float (&s)[RB], const float (&vf)[DPL], const int j,
    const int stop, const int n_keys, const int row0, float (&m)[RB], float (&s_sum)[RB], float (&acc)[RB][DPL]) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    if (j >= stop || j > n_keys - L + ((row0 + r) % L)) continue;
    if (s[r] > m[r]) {
      const float fade = exp2f(m[r] - s[r]);
      m[r] = s[r];
      s_sum[r] *= fade;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[r][d] *= fade;
    }
    const float p = exp2f(s[r] - m[r]);
    s_sum[r] += p;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[r][d] += p * vf[d];
  }
}
"""

# Template constants: InT (the activations' dtype), D (head dim), BITS, GK/GV (key/value
# group sizes), L (queries in the pass), REP (query heads per KV head), RB (query rows a
# block takes), NW (warps), LPK (lanes per key: a warp reads 32 / LPK keys at once), KPL
# (keys each lane group loads before computing), NKV (KV heads; merge only). A model
# compiles a few: one per L.
# A lane's place: its lane group (a key) and its share of the head's dimensions.
LANES = """
  constexpr int R = REP * L;  // query rows reading this KV head; a block (or warp) takes RB of them
  constexpr int DPL = D / LPK;
  constexpr int G = 32 / LPK;
  const float NEG = neg_inf();
  const int lane = threadIdx.x & 31;
  const int grp = lane / LPK, sub = lane % LPK;
"""
# Given ``split`` of ``n_splits``: the KV head, the query rows and the keys [first, stop).
SLICE = """
  const int bh = blockIdx.z / (R / RB);
  const int row0 = (blockIdx.z % (R / RB)) * RB;
  const int b = bh / n_kv, h = bh % n_kv;
  const int chunk = (n_keys + n_splits - 1) / n_splits;
  const int first = split * chunk;
  const int stop = min(first + chunk, n_keys);
  const float scale = sc[0] * 1.44269504088896340736f;  // log2(e): exp2 below
"""
_SETUP = (
    LANES
    + """
  const int warp = threadIdx.x >> 5;
  const int walker = warp * G + grp;  // this lane group's share of the slice
  const int split = blockIdx.y;
  const int n_splits = gridDim.y;
"""
    + SLICE
    + """
  float qv[RB][DPL];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int head = h * REP + (row0 + r) / L, l = (row0 + r) % L;
    const InT* row = q + (((long)b * (n_kv * REP) + head) * L + l) * D + sub * DPL;
#pragma unroll
    for (int d = 0; d < DPL; ++d) qv[r][d] = static_cast<float>(row[d]) * scale;
  }
  float m[RB], s_sum[RB], acc[RB][DPL];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    m[r] = NEG;
    s_sum[r] = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[r][d] = 0.f;
  }
"""
)

# The quantized cache's walk: each lane group loads KPL keys' codes, dequantizes at use.
_WALK = """
  constexpr unsigned CODE = (1u << BITS) - 1u;
  const long kbase = (long)b * kw_strides[0] + (long)h * kw_strides[1];
  const long ksbase = (long)b * ks_strides[0] + (long)h * ks_strides[1];
  const long vbase = (long)b * vw_strides[0] + (long)h * vw_strides[1];
  const long vsbase = (long)b * vs_strides[0] + (long)h * vs_strides[1];
  const int kgroup = (sub * DPL) / GK, vgroup = (sub * DPL) / GV;

  // This lane's share of a row: DPL codes from bit `lead` on, in WPL words; with under a
  // word each (4-bit codes, few dimensions a lane) it starts inside its one word.
  constexpr int WPL = (DPL * BITS + 31) / 32;
  constexpr bool WHOLE = DPL * BITS >= 32;
  const int lead = sub * DPL * BITS;
  const int w0 = lead >> 5, lead_shift = lead & 31;

  // Every lane runs the same iterations (the shuffles below take the whole warp); a lane
  // group past its keys computes on a repeated key and masks it out.
  for (int j0 = first + warp * G * KPL; j0 < stop; j0 += NW * G * KPL) {
    // Load KPL keys' codes and scales first (loads in flight together), dequantize at use.
    uint32_t kc[KPL][WPL], vc[KPL][WPL];
    float k_scale[KPL], k_bias[KPL], v_scale[KPL], v_bias[KPL];
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
      const int j = min(j0 + u * G + grp, stop - 1);
      const uint32_t* krow = kw + kbase + (long)j * kw_strides[2] + w0;
      const uint32_t* vrow = vw + vbase + (long)j * vw_strides[2] + w0;
      if constexpr (WPL == 4) {
        const uint4 kq = *reinterpret_cast<const uint4*>(krow);
        const uint4 vq = *reinterpret_cast<const uint4*>(vrow);
        kc[u][0] = kq.x; kc[u][1] = kq.y; kc[u][2] = kq.z; kc[u][3] = kq.w;
        vc[u][0] = vq.x; vc[u][1] = vq.y; vc[u][2] = vq.z; vc[u][3] = vq.w;
      } else if constexpr (WPL == 2) {
        const uint2 kq = *reinterpret_cast<const uint2*>(krow);
        const uint2 vq = *reinterpret_cast<const uint2*>(vrow);
        kc[u][0] = kq.x; kc[u][1] = kq.y;
        vc[u][0] = vq.x; vc[u][1] = vq.y;
      } else {
#pragma unroll
        for (int w = 0; w < WPL; ++w) {
          kc[u][w] = krow[w];
          vc[u][w] = vrow[w];
        }
      }
      k_scale[u] = static_cast<float>(ks[ksbase + (long)j * ks_strides[2] + kgroup]);
      k_bias[u] = static_cast<float>(kb[ksbase + (long)j * ks_strides[2] + kgroup]);
      v_scale[u] = static_cast<float>(vs[vsbase + (long)j * vs_strides[2] + vgroup]);
      v_bias[u] = static_cast<float>(vb[vsbase + (long)j * vs_strides[2] + vgroup]);
    }
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
      const int j = j0 + u * G + grp;
      float kf[DPL], s[RB];
#pragma unroll
      for (int d = 0; d < DPL; ++d) {
        const int bit = WHOLE ? d * BITS : lead_shift + d * BITS;
        kf[d] = static_cast<float>((kc[u][WHOLE ? bit >> 5 : 0] >> (bit & 31)) & CODE) * k_scale[u] + k_bias[u];
      }
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        s[r] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) s[r] += qv[r][d] * kf[d];
      }
      // The rows' sums interleave: each shuffle round serves every row at once.
#pragma unroll
      for (int o = LPK / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < RB; ++r) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
      }
      float vf[DPL];
#pragma unroll
      for (int d = 0; d < DPL; ++d) {
        const int bit = WHOLE ? d * BITS : lead_shift + d * BITS;
        vf[d] = static_cast<float>((vc[u][WHOLE ? bit >> 5 : 0] >> (bit & 31)) & CODE) * v_scale[u] + v_bias[u];
      }
      online_softmax<RB, DPL, L>(s, vf, j, stop, n_keys, row0, m, s_sum, acc);
    }
  }
"""

# The block's lane groups merge their partial softmaxes and write the slice's partial result.
_BLOCK_MERGE = """
  // Merge the block's lane groups (NW * G partial softmaxes) through shared memory.
  __shared__ float sh_m[NW * G][RB];
  __shared__ float sh_sum[NW * G][RB];
  __shared__ float sh_acc[NW * G][RB][D];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int d = 0; d < DPL; ++d) sh_acc[walker][r][sub * DPL + d] = acc[r][d];
    if (sub == 0) {
      sh_m[walker][r] = m[r];
      sh_sum[walker][r] = s_sum[r];
    }
  }
  __syncthreads();
  const long out_row = ((long)bh * n_splits + split) * R + row0;
  for (int i = threadIdx.x; i < RB * D; i += NW * 32) {
    const int r = i / D, d = i % D;
    float top = NEG;
    for (int w = 0; w < NW * G; ++w) top = fmaxf(top, sh_m[w][r]);
    float a = 0.f, total = 0.f;
    if (top != NEG) {
      for (int w = 0; w < NW * G; ++w) {
        const float f = exp2f(sh_m[w][r] - top);
        a += f * sh_acc[w][r][d];
        total += f * sh_sum[w][r];
      }
    }
    part_acc[(out_row + r) * D + d] = a;
    if (d == 0) {
      part_max[out_row + r] = top;
      part_sum[out_row + r] = total;
    }
  }
"""

# One block per (KV head, query row), a thread per dimension: merge the slices' partials.
_MERGE = """
  constexpr int R = REP * L;
  const int d = threadIdx.x;
  const int r = blockIdx.y;
  const int bh = blockIdx.z;
  const int n_splits = part_max_shape[1];
  const int b = bh / NKV, h = bh % NKV;
  const long row0 = (long)bh * n_splits * R + r;
  float top = neg_inf();
  for (int s = 0; s < n_splits; ++s) top = fmaxf(top, part_max[row0 + (long)s * R]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < n_splits; ++s) {
    const float mx_s = part_max[row0 + (long)s * R];
    if (mx_s == neg_inf()) continue;
    const float f = exp2f(mx_s - top);
    num += f * part_acc[(row0 + (long)s * R) * D + d];
    den += f * part_sum[row0 + (long)s * R];
  }
  const int head = h * REP + r / L, l = r % L;
  out[(((long)b * (NKV * REP) + head) * L + l) * D + d] = static_cast<InT>(num / den);
"""


# The partial kernel's body as it is built (header: ``_HEADER``).
PARTIAL_SOURCE = "const int n_kv = kw_shape[1], n_keys = kw_shape[2];" + _SETUP + _WALK + _BLOCK_MERGE


@cache
def _kernels():
    partial = cuda_kernel(
        name="quantized_kv_attention_partial",
        input_names=["q", "sc", "kw", "ks", "kb", "vw", "vs", "vb"],
        output_names=["part_acc", "part_max", "part_sum"],
        source=PARTIAL_SOURCE,
        header=_HEADER,
        ensure_row_contiguous=False,  # the cache's codes are read in place, strided by its capacity
    )
    merge = cuda_kernel(
        name="quantized_kv_attention_merge",
        input_names=["part_acc", "part_max", "part_sum"],
        output_names=["out"],
        source=_MERGE,
        header=_HEADER,
    )
    return partial, merge


@cache
def _scale_array(scale: float) -> mx.array:
    """The softmax scale as an input (kernels take no scalar arguments): one array per model
    scale, not one per layer and token (an array made anew is a host-to-device copy each pass)."""
    return mx.array([scale], mx.float32)


@cache
def _cuda_build() -> bool:
    return mx.cuda.is_available()


def available() -> bool:
    """Whether the kernels can run here: MLX's CUDA backend, on the GPU. (Asked before every
    attention pass of a step, so the backend's answer is kept.)"""
    return _cuda_build() and mx.default_device() == mx.gpu


def _lanes_per_key(rows: int, head_dim: int) -> int:
    """The fewest lanes per key (8, 16 or 32) whose share of the dimensions leaves each lane
    at most LANE_ROW_FLOATS floats per query row set."""
    for lanes in (8, 16, 32):
        if rows * (head_dim // lanes) <= LANE_ROW_FLOATS:
            return lanes
    return 32


def _keys_per_load(dims_per_lane: int, bits: int) -> int:
    """Keys a lane group loads before computing: as many as LANE_LOAD_REGS registers hold
    (each key: its codes' words for keys and values, and two scales and two biases)."""
    words = (dims_per_lane * bits + 31) // 32
    return max(1, min(8, LANE_LOAD_REGS // (2 * words + 4)))


def _rows_per_block(rows: int) -> int:
    """The most query rows one block takes (at most ROWS_PER_BLOCK, dividing ``rows``): a
    verify pass with more rows splits them across blocks, each reading the slice again."""
    return max(n for n in range(1, min(rows, ROWS_PER_BLOCK) + 1) if rows % n == 0)


def fits(n_heads: int, n_kv: int, n_queries: int, head_dim: int, groups: tuple[int, int], mask) -> bool:
    """Whether the fused kernels take this pass (else the caller dequantizes)."""
    if n_kv == 0 or n_heads % n_kv:
        return False
    rows = _rows_per_block((n_heads // n_kv) * n_queries)
    return (
        (mask is None or (isinstance(mask, str) and mask == "causal"))
        and head_dim % 32 == 0
        and head_dim <= 256
        # a lane's dimensions share one scale
        and all(head_dim // _lanes_per_key(rows, head_dim) <= g for g in groups)
    )


def plan(
    b: int, n_heads: int, n_kv: int, n_q: int, n_keys: int, d: int, dtype: mx.Dtype, bits: int, groups: tuple[int, int]
) -> tuple[list[tuple[str, object]], int, int]:
    """The partial kernel's template constants, its slices of the keys (the grid's y) and its
    blocks for each slice (KV heads times groups of query rows, the grid's z)."""
    rows = (n_heads // n_kv) * n_q
    block_rows = _rows_per_block(rows)
    row_groups = rows // block_rows
    splits = max(1, min(math.ceil(TARGET_BLOCKS / (b * n_kv * row_groups)), math.ceil(n_keys / MIN_SLICE)))
    lanes = _lanes_per_key(block_rows, d)
    template: list[tuple[str, object]] = [
        ("InT", dtype),
        ("D", d),
        ("BITS", bits),
        ("GK", groups[0]),
        ("GV", groups[1]),
        ("L", n_q),
        ("REP", n_heads // n_kv),
        ("RB", block_rows),
        ("NW", WARPS),
        ("LPK", lanes),
        ("KPL", _keys_per_load(d // lanes, bits)),
    ]
    return template, splits, b * n_kv * row_groups


def attend(
    queries: mx.array,
    scale: float,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    bits: int,
    groups: tuple[int, int],
) -> mx.array:
    """Causal attention of ``queries`` [B, heads, L, D] over the cache's first T tokens:
    ``keys``/``values`` are the (codes, scales, biases) triples of row-contiguous buffers
    sliced to T along axis 2 (the kernel reads them in place through their strides)."""
    b, n_heads, n_q, d = queries.shape
    n_kv = keys[0].shape[1]
    rep = n_heads // n_kv
    q = mx.contiguous(queries)
    rows = rep * n_q
    template, splits, blocks = plan(b, n_heads, n_kv, n_q, keys[0].shape[2], d, queries.dtype, bits, groups)
    partial, merge = _kernels()
    part_acc, part_max, part_sum = partial(
        inputs=[q, _scale_array(scale), *keys, *values],
        template=template,
        grid=(WARPS * 32, splits, blocks),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(b * n_kv, splits, rows, d), (b * n_kv, splits, rows), (b * n_kv, splits, rows)],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = merge(
        inputs=[part_acc, part_max, part_sum],
        template=[("InT", queries.dtype), ("D", d), ("L", n_q), ("REP", rep), ("NKV", n_kv)],
        grid=(d, rows, b * n_kv),
        threadgroup=(d, 1, 1),
        output_shapes=[(b, n_heads, n_q, d)],
        output_dtypes=[queries.dtype],
    )
    return out
