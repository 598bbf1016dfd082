"""Decode attention over a full-precision KV cache on CUDA, split over the cached tokens
("flash decoding"), for a step's few queries over a short cache.

MLX's CUDA attention gives a one-query pass of up to 1,024 keys one block per query head
(``sdpa_vector_1pass``): qwen3-4b's 32 heads run on 32 of an H200's 132 multiprocessors, and
each block's warps walk their keys one after another. Measured inside a decode step (Nsight
Compute, each kernel's own time), that pass took 20 us a layer over 520 keys, 0.73 of a
3.1 ms step, to read 2 MB. MLX's two-pass kernel, which splits the keys, starts at 1,024
keys. This one splits any cache into slices of a few dozen keys, a warp each: a warp loads
its slice's rows at once (its lane groups a key each, the lanes across the head dimension),
keeps an online softmax for every query row that reads its KV head (grouped heads times the
pass's queries), merges its lane groups by shuffles and writes one partial result; a second
kernel merges the slices, a block a row. No warp waits on another: the first build of this
kernel gave a block's 16 lane groups one slice of 31 keys and merged them through shared
memory, and on an H100 that setup and merge were most of its 24-37 us a pass over 520 keys,
against cuDNN's 13-14 (one warp a scheduler, latency-bound: docs/qmv.md, "Attention inside
the compiled step"). The warp a slice halved a warp's instructions but not the time (44.8 us
chained over 520 keys against MLX's 18.7; docs/qmv.md, "A warp a slice"): 70% of its stalls
waited on the query, then loaded two bytes at a time before any key, which its rows now load
whole, their round trip overlapping the keys'.

Only plain causal attention is taken (no mask for one query, or the "causal" string), for
at most ``MAX_QUERIES`` queries and ``MAX_KEYS`` keys; the rest keeps MLX's kernel.

Off (``MLX_DESK_DECODE_ATTENTION=1`` turns it on) until measured faster. Called outside the
compiled step, the first build lost 9-29% of whole decode on H100s (two kernel calls a layer
built in Python each token where MLX's attention is one); a compiled step now runs it inside
its traced functions (``attend_counted``: the key count an input, the whole cache buffer
read), where the first build decoded at 0.98x and the warp a slice at 0.955x, its kernels
the slower ones. Its source is checked on the CPU against MLX's attention
(tests/engine/models/test_decode_attention_emulated.py) and built with NVIDIA's compiler
where installed (233 registers a thread at qwen3-4b's step, no spills).
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

from engine.models import quantized_attention_cuda as shared
from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch

ENV = "MLX_DESK_DECODE_ATTENTION"
# A verify pass's queries at most (their running sums live in registers, as for the
# quantized cache).
MAX_QUERIES = 8
# Longer caches keep MLX's kernels (its two-pass kernel from 1,024 keys, cuDNN from whole
# steps of 256 past ``cache_buffers.buffer_tokens``'s limit), which were not measured against this.
MAX_KEYS = 6144
# Warps a block: independent (each its own slice), grouped only so a launch has fewer blocks.
WARPS = 4
# Keys a warp walks in a short cache: 520 keys of qwen3-4b's 8 KV heads make 20 slices (17
# rounded up to whole blocks), 160 warps, each one or two passes of its loop. Longer caches
# give each warp more keys past ``TARGET_WARPS``.
KEYS_PER_WARP = 32
# Warps to aim for across the KV heads: eight a multiprocessor of an H200 (132), enough in
# flight to cover the memory's latency, few enough that the partial results stay small.
TARGET_WARPS = 1056
# Floats a lane holds per query row set (its query share, and again its running sums), and
# registers for the keys and values it loads ahead with their scores.
LANE_ROW_FLOATS = 32
LANE_LOAD_REGS = 96
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

_HEADER = """
// A lane's P consecutive values of a key or value row, loaded whole (16 or 8 bytes at a
// time) where the row and its stride allow.
template <typename T, int P>
struct alignas(P * sizeof(T) % 16 == 0 ? 16 : (P * sizeof(T) == 8 ? 8 : alignof(T))) Lanes {
  T v[P];
};

template <typename T, int P>
__device__ __forceinline__ bool lanes_whole(const T* base, long stride, long step) {
  constexpr int BYTES = P * (int)sizeof(T);
  if constexpr (BYTES % 16 != 0 && BYTES != 8) return false;  // loaded value by value
  constexpr unsigned long long A = BYTES % 16 == 0 ? 16 : 8;
  if (step != 1) return false;
  return ((reinterpret_cast<unsigned long long>(base) | (unsigned long long)(stride * (long)sizeof(T))) % A) == 0;
}

template <typename T, int P>
__device__ __forceinline__ Lanes<T, P> load_lanes(const T* p, bool whole, long step) {
  Lanes<T, P> out;
  constexpr int BYTES = P * (int)sizeof(T);
  if constexpr (BYTES % 16 == 0) {
    if (whole) {
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i) reinterpret_cast<uint4*>(&out)[i] = reinterpret_cast<const uint4*>(p)[i];
      return out;
    }
  } else if constexpr (BYTES == 8) {
    if (whole) {
      *reinterpret_cast<uint2*>(&out) = *reinterpret_cast<const uint2*>(p);
      return out;
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) out.v[i] = p[i * step];
  return out;
}
"""

# Each warp walks its own slice of the keys: no block merge, no barrier. A warp's G lane
# groups (LPK lanes a key, DPL dimensions a lane) load KPL keys each at once, so a pass of
# the loop holds G * KPL keys' rows in flight; their scores join the running softmax as one
# chunk (one maximum, one rescale of the sums a pass, not one a key); the groups then merge
# by shuffles and the warp's first group writes the slice's partial result.
_WARP_SLICE = (
    shared.LANES
    + """
  const int n_splits = gridDim.y * NW;
  const int split = blockIdx.y * NW + (threadIdx.x >> 5);
"""
    + shared.SLICE
    + """
  // The query rows are loaded whole (16 or 8 bytes a lane) and converted in each pass after
  // its keys' loads are issued, so their round trip overlaps the keys' instead of preceding it.
  Lanes<InT, DPL> qraw[RB];
  float m[RB], s_sum[RB], acc[RB][DPL];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int head = h * REP + (row0 + r) / L, l = (row0 + r) % L;
    const InT* row = q + (((long)b * (n_kv * REP) + head) * L + l) * D + sub * DPL;
    qraw[r] = load_lanes<InT, DPL>(row, lanes_whole<InT, DPL>(row, D, 1), 1);
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[r][d] = 0.f;
    m[r] = NEG;
    s_sum[r] = 0.f;
  }
  const long kbase = (long)b * k_strides[0] + (long)h * k_strides[1] + (long)sub * DPL * k_strides[3];
  const long vbase = (long)b * v_strides[0] + (long)h * v_strides[1] + (long)sub * DPL * v_strides[3];
  const bool whole = lanes_whole<InT, DPL>(k + kbase, k_strides[2], k_strides[3])
      && lanes_whole<InT, DPL>(v + vbase, v_strides[2], v_strides[3]);
  for (int j0 = first; j0 < stop; j0 += G * KPL) {
    Lanes<InT, DPL> kr[KPL], vr[KPL];
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
      const int j = min(j0 + u * G + grp, stop - 1);  // past the slice: a repeated key, left out
      kr[u] = load_lanes<InT, DPL>(k + kbase + (long)j * k_strides[2], whole, k_strides[3]);
      vr[u] = load_lanes<InT, DPL>(v + vbase + (long)j * v_strides[2], whole, v_strides[3]);
    }
    float s[KPL][RB];
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        s[u][r] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) s[u][r] += static_cast<float>(qraw[r].v[d]) * static_cast<float>(kr[u].v[d]);
      }
    }
    // Every key's and row's sums interleave: each shuffle round serves all of them at once.
#pragma unroll
    for (int o = LPK / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < KPL; ++u) {
#pragma unroll
        for (int r = 0; r < RB; ++r) s[u][r] += __shfl_xor_sync(0xffffffff, s[u][r], o);
      }
    }
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
#pragma unroll
      for (int r = 0; r < RB; ++r) s[u][r] *= scale;
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      // Past the slice, or after the row's own position (causal: query l of L sees keys up
      // to its own), a key is left out.
      const int last = n_keys - L + ((row0 + r) % L);
      float top = m[r];
#pragma unroll
      for (int u = 0; u < KPL; ++u) {
        const int j = j0 + u * G + grp;
        if (j >= stop || j > last) s[u][r] = NEG;
        top = fmaxf(top, s[u][r]);
      }
      if (top == NEG) continue;  // no key of this row yet
      const float fade = exp2f(m[r] - top);
      m[r] = top;
      s_sum[r] *= fade;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[r][d] *= fade;
#pragma unroll
      for (int u = 0; u < KPL; ++u) {
        const float p = exp2f(s[u][r] - top);
        s_sum[r] += p;
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[r][d] += p * static_cast<float>(vr[u].v[d]);
      }
    }
  }
  // The warp's lane groups merge: lanes LPK apart hold the same dimensions of other keys.
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float om = __shfl_xor_sync(0xffffffff, m[r], o);
      const float osum = __shfl_xor_sync(0xffffffff, s_sum[r], o);
      const float top = fmaxf(m[r], om);
      const float f = top == NEG ? 0.f : exp2f(m[r] - top);
      const float of = top == NEG ? 0.f : exp2f(om - top);
      s_sum[r] = s_sum[r] * f + osum * of;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[r][d] = acc[r][d] * f + __shfl_xor_sync(0xffffffff, acc[r][d], o) * of;
      m[r] = top;
    }
  }
  if (grp == 0) {
    const long out_row = ((long)bh * n_splits + split) * R + row0;
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      float* out = part_acc + (out_row + r) * D + sub * DPL;
      if constexpr (DPL % 4 == 0) {  // 16-byte stores: D is a multiple of 32, DPL of 4
#pragma unroll
        for (int d = 0; d < DPL; d += 4) *reinterpret_cast<float4*>(out + d) = make_float4(acc[r][d], acc[r][d + 1], acc[r][d + 2], acc[r][d + 3]);
      } else {
#pragma unroll
        for (int d = 0; d < DPL; ++d) out[d] = acc[r][d];
      }
      if (sub == 0) {
        part_max[out_row + r] = m[r];
        part_sum[out_row + r] = s_sum[r];
      }
    }
  }
"""
)


# One block per (KV head, query row): merge the warps' partial results. With slices of a few
# dozen keys there are tens of them a row, so the block spreads them over its threads: every
# thread weighs a share of the slices (their maxima against the row's), and each warp sums a
# share of the slices' values, a lane a few dimensions; the warps' sums then add up.
_MERGE = """
  constexpr int R = REP * L;
  constexpr int DPT = D / 32;  // dimensions a lane sums
  constexpr int MW = MERGE_THREADS / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = blockIdx.y, bh = blockIdx.z;
  const int n_splits = part_max_shape[1];
  const int b = bh / NKV, h = bh % NKV;
  const long row0 = (long)bh * n_splits * R + r;
  const float NEG = neg_inf();
  __shared__ float weight[MAX_SLICES];
  __shared__ float warp_top[MW], warp_den[MW];
  __shared__ float warp_acc[MW][D];

  float top = NEG;
  for (int s = tid; s < n_splits; s += MERGE_THREADS) top = fmaxf(top, part_max[row0 + (long)s * R]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
  if (lane == 0) warp_top[warp] = top;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < MW; ++w) top = fmaxf(top, warp_top[w]);
  float den = 0.f;
  for (int s = tid; s < n_splits; s += MERGE_THREADS) {
    const float m_s = part_max[row0 + (long)s * R];
    const float f = m_s == NEG ? 0.f : exp2f(m_s - top);  // a slice with none of this row's keys
    weight[s] = f;
    den += f * part_sum[row0 + (long)s * R];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffff, den, o);
  if (lane == 0) warp_den[warp] = den;
  __syncthreads();
  float a[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) a[i] = 0.f;
  for (int s = warp; s < n_splits; s += MW) {
    const float f = weight[s];
    const float* row = part_acc + (row0 + (long)s * R) * D + lane * DPT;
#pragma unroll
    for (int i = 0; i < DPT; ++i) a[i] += f * row[i];
  }
#pragma unroll
  for (int i = 0; i < DPT; ++i) warp_acc[warp][lane * DPT + i] = a[i];
  __syncthreads();
  den = 0.f;
#pragma unroll
  for (int w = 0; w < MW; ++w) den += warp_den[w];
  const int head = h * REP + r / L, l = r % L;
  for (int d = tid; d < D; d += MERGE_THREADS) {
    float num = 0.f;
#pragma unroll
    for (int w = 0; w < MW; ++w) num += warp_acc[w][d];
    out[(((long)b * (NKV * REP) + head) * L + l) * D + d] = static_cast<InT>(num / den);
  }
"""
# Threads of a merge block, and the most slices a row may have (TARGET_WARPS for one KV head).
MERGE_THREADS = 128
MAX_SLICES = TARGET_WARPS


# The partial kernel as it is built: its body, and its header (the quantized cache's helpers
# and the whole-lane loads above).
PARTIAL_SOURCE = "const int n_kv = k_shape[1], n_keys = k_shape[2];" + _WARP_SLICE
# The same kernel over a whole cache buffer, its key count an input (``nk``, int32 [1]) rather
# than the keys' shape: its shapes then stay the same from token to token, so it can run
# inside the compiled step (``attend_counted``). The slices divide the count, not the buffer.
COUNTED_SOURCE = "const int n_kv = k_shape[1], n_keys = nk[0];" + _WARP_SLICE
PARTIAL_HEADER = shared._HEADER + _HEADER
MERGE_HEADER = shared._HEADER + f"constexpr int MERGE_THREADS = {MERGE_THREADS}, MAX_SLICES = {MAX_SLICES};\n"


@cache
def _merge():
    return cuda_kernel(
        name="decode_attention_merge",
        input_names=["part_acc", "part_max", "part_sum"],
        output_names=["out"],
        source=_MERGE,
        header=MERGE_HEADER,
    )


@cache
def _partial(counted: bool = False):
    return cuda_kernel(
        name="decode_attention_counted" if counted else "decode_attention_partial",
        input_names=["q", "sc", "nk", "k", "v"] if counted else ["q", "sc", "k", "v"],
        output_names=["part_acc", "part_max", "part_sum"],
        source=COUNTED_SOURCE if counted else PARTIAL_SOURCE,
        header=PARTIAL_HEADER,
        ensure_row_contiguous=False,  # the cache is read in place, strided by its capacity
    )


def enabled() -> bool:
    """Whether passes take the kernels: turned on (``MLX_DESK_DECODE_ATTENTION=1``) where the
    quantized cache's kernels can run (MLX's CUDA backend, on the GPU)."""
    return switch(ENV, "0") == "1" and shared.available()


def _lanes_per_key(rows: int, head_dim: int) -> int:
    """The fewest lanes per key (8, 16 or 32) whose share of the dimensions leaves each lane
    at most LANE_ROW_FLOATS floats per query row set."""
    return next((n for n in (8, 16) if rows * (head_dim // n) <= LANE_ROW_FLOATS), 32)


def _keys_per_load(dims_per_lane: int, itemsize: int, rows: int) -> int:
    """Keys a lane group loads before computing: as many as LANE_LOAD_REGS registers hold
    (each key: its row and its value row, ``dims_per_lane`` values each, and a score a row)."""
    words = -(-dims_per_lane * itemsize // 4)
    return max(1, min(8, LANE_LOAD_REGS // (2 * words + rows)))


def takes(q: mx.array, k: mx.array, v: mx.array, mask) -> bool:
    """Whether attention of ``q`` [B, heads, L, D] over ``k``/``v`` [B, kv heads, T, D] with
    ``mask`` goes through the kernels."""
    # Off (everywhere by default) costs every attention pass of a step one check, not the shapes'.
    if not enabled() or q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or v.dtype != k.dtype:
        return False
    b, n_heads, n_q, d = q.shape
    return (
        n_q <= k.shape[2]
        and k.shape[0] == b
        and k.shape[3] == d
        and k.dtype == q.dtype
        and fits(n_heads, k.shape[1], n_q, k.shape[2], d, q.dtype, mask)
    )


def fits(n_heads: int, n_kv: int, n_q: int, n_keys: int, d: int, dtype: mx.Dtype, mask) -> bool:
    """Whether the kernels take causal attention (no mask is causal for one query only) of
    ``n_q`` queries over ``n_keys`` keys (or a buffer of that capacity), their shapes and
    dtype as given."""
    return (
        ((mask is None and n_q == 1) or (isinstance(mask, str) and mask == "causal"))
        and 1 <= n_q <= MAX_QUERIES
        and n_keys <= MAX_KEYS
        and n_kv > 0
        and n_heads % n_kv == 0
        and d % 32 == 0
        and d <= 256
        and dtype in DTYPES
    )


def plan(
    b: int, n_heads: int, n_kv: int, n_q: int, n_keys: int, d: int, dtype: mx.Dtype
) -> tuple[list[tuple[str, object]], int, int]:
    """The partial kernel's template constants, its slices of the keys (a warp each, WARPS a
    block along the grid's y) and its blocks for each slice group (KV heads times groups of
    query rows, the grid's z)."""
    rows = (n_heads // n_kv) * n_q
    block_rows = shared._rows_per_block(rows)
    row_groups = rows // block_rows
    slices = min(math.ceil(n_keys / KEYS_PER_WARP), math.ceil(TARGET_WARPS / (b * n_kv * row_groups)))
    slices = WARPS * max(1, math.ceil(slices / WARPS))
    lanes = _lanes_per_key(block_rows, d)
    # No more keys a lane group loads than its share of a slice: short slices take one pass
    # of the loop without loading repeated keys.
    group_share = math.ceil(math.ceil(n_keys / slices) / (32 // lanes))
    template: list[tuple[str, object]] = [
        ("InT", dtype),
        ("D", d),
        ("L", n_q),
        ("REP", n_heads // n_kv),
        ("RB", block_rows),
        ("NW", WARPS),
        ("LPK", lanes),
        ("KPL", min(group_share, _keys_per_load(d // lanes, dtype.size, block_rows))),
    ]
    return template, slices, b * n_kv * row_groups


@cache
def _launches(b: int, n_heads: int, n_kv: int, n_q: int, n_keys: int, d: int, dtype: mx.Dtype) -> tuple[dict, dict]:
    """The two kernels' launch arguments for a pass of these sizes, made once: a pass outside
    the compiled step runs once a layer and token, so what it builds in Python is host time in
    every layer (``plan`` alone took 6.5 us a call on a CPU, about two thirds of what MLX's
    attention call costs the host whole)."""
    rows = (n_heads // n_kv) * n_q
    template, slices, blocks = plan(b, n_heads, n_kv, n_q, n_keys, d, dtype)
    partial = dict(
        template=template,
        grid=(WARPS * 32, slices // WARPS, blocks),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(b * n_kv, slices, rows, d), (b * n_kv, slices, rows), (b * n_kv, slices, rows)],
        output_dtypes=[mx.float32] * 3,
    )
    merge = dict(
        template=[("InT", dtype), ("D", d), ("L", n_q), ("REP", n_heads // n_kv), ("NKV", n_kv)],
        grid=(MERGE_THREADS, rows, b * n_kv),
        threadgroup=(MERGE_THREADS, 1, 1),
        output_shapes=[(b, n_heads, n_q, d)],
        output_dtypes=[dtype],
    )
    return partial, merge


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of ``queries`` [B, heads, L, D] over ``keys``/``values`` [B, kv heads,
    T, D] (the last L keys are the queries' own positions), as
    ``mx.fast.scaled_dot_product_attention`` computes it; ``takes`` says which passes."""
    b, n_heads, n_q, d = queries.shape
    partial, merge = _launches(b, n_heads, keys.shape[1], n_q, keys.shape[2], d, queries.dtype)
    part_acc, part_max, part_sum = _partial()(
        inputs=[mx.contiguous(queries), shared._scale_array(scale), keys, values], **partial
    )
    (out,) = _merge()(inputs=[part_acc, part_max, part_sum], **merge)
    return out


def attend_counted(queries: mx.array, buffer: mx.array, n_keys: mx.array, scale: float) -> mx.array:
    """``attend`` over the first ``n_keys`` (int32 [1], at least the queries' count) keys and
    values of a cache buffer [2, B, kv heads, capacity, D], read in place. Its shapes follow
    the buffer's capacity, not the count, so a compiled step traces it once a capacity;
    ``fits`` says which passes (the count as the key count). The number of slices is
    planned for the capacity and their length from the count (``_SETUP``'s ``chunk``), so
    every slice has keys however far the buffer reaches past them."""
    b, n_heads, n_q, d = queries.shape
    _, _, n_kv, capacity, _ = buffer.shape
    partial, merge = _launches(b, n_heads, n_kv, n_q, capacity, d, queries.dtype)
    # ``buffer[i, :]``: a view (a lone integer index would be a gather that copies).
    part_acc, part_max, part_sum = _partial(counted=True)(
        inputs=[mx.contiguous(queries), shared._scale_array(scale), n_keys, buffer[0, :], buffer[1, :]], **partial
    )
    (out,) = _merge()(inputs=[part_acc, part_max, part_sum], **merge)
    return out
