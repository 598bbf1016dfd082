"""Decode attention over a full-precision KV cache on CUDA, split over the cached tokens
("flash decoding"), for a step's few queries over a short cache.

MLX's CUDA attention gives a one-query pass of up to 1,024 keys one block per query head
(``sdpa_vector_1pass``): qwen3-4b's 32 heads run on 32 of an H200's 132 multiprocessors, and
each block's warps walk their keys one after another. Measured inside a decode step (Nsight
Compute, each kernel's own time), that pass took 20 us a layer over 520 keys, 0.73 of a
3.1 ms step, to read 2 MB. MLX's two-pass kernel, which splits the keys, starts at 1,024
keys. This one splits any cache into slices across blocks, as the quantized cache's kernels
do (models.quantized_attention_cuda, whose setup, running softmax and merges it shares):
a block takes one KV head, the query rows that read it and one slice of the keys, its lane
groups walk the slice a few keys ahead, and a second kernel merges the slices.

Only plain causal attention is taken (no mask for one query, or the "causal" string), for
at most ``MAX_QUERIES`` queries and ``MAX_KEYS`` keys; the rest keeps MLX's kernel.

Off (``MLX_DESK_DECODE_ATTENTION=1`` turns it on): on an H100 qwen3-4b decoded at 297.1 tok/s
with it against 327.2 without (docs/qmv.md, "Registers"), and again, its scale array now made
once, at 162.2 against 227.2 and 214.6, llama3-8b at 195.0 against 273.3 ("Memory waits").
Those runs called it outside the compiled step, two kernel calls a layer built in Python each
token where MLX's attention is one, on hosts that already spent most of a step's time
handing it over. A compiled step now runs it inside its traced functions
(``attend_counted``: the key count an input, the whole cache buffer read), so a step builds
none of it in Python; on an H100 that decoded at 0.98x of the default, the kernel itself
being the slower one (24-37 us a pass over 520 keys against cuDNN's 13-14, latency-bound at
one warp a scheduler: docs/qmv.md, "Attention inside the compiled step"). Its source is checked on the CPU against MLX's
attention (tests/engine/models/test_decode_attention_emulated.py) and built with NVIDIA's
compiler where installed (253 registers a thread at qwen3-4b's step).
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
# Fewest keys per slice: a short cache still spreads over the multiprocessors (520 keys of
# 8 KV heads: 17 slices, 136 blocks), its partial results a few KB.
MIN_SLICE = 32
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

# Each lane group loads KPL keys and their values as they are stored, converts at use.
_WALK = """
  const long kbase = (long)b * k_strides[0] + (long)h * k_strides[1] + (long)sub * DPL * k_strides[3];
  const long vbase = (long)b * v_strides[0] + (long)h * v_strides[1] + (long)sub * DPL * v_strides[3];
  const bool whole = lanes_whole<InT, DPL>(k + kbase, k_strides[2], k_strides[3])
      && lanes_whole<InT, DPL>(v + vbase, v_strides[2], v_strides[3]);
  for (int j0 = first + warp * G * KPL; j0 < stop; j0 += NW * G * KPL) {
    Lanes<InT, DPL> kr[KPL], vr[KPL];
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
      const int j = min(j0 + u * G + grp, stop - 1);
      kr[u] = load_lanes<InT, DPL>(k + kbase + (long)j * k_strides[2], whole, k_strides[3]);
      vr[u] = load_lanes<InT, DPL>(v + vbase + (long)j * v_strides[2], whole, v_strides[3]);
    }
#pragma unroll
    for (int u = 0; u < KPL; ++u) {
      const int j = j0 + u * G + grp;
      float s[RB];
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        s[r] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) s[r] += qv[r][d] * static_cast<float>(kr[u].v[d]);
      }
#pragma unroll
      for (int o = LPK / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < RB; ++r) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
      }
      float vf[DPL];
#pragma unroll
      for (int d = 0; d < DPL; ++d) vf[d] = static_cast<float>(vr[u].v[d]);
      online_softmax<RB, DPL, L>(s, vf, j, stop, n_keys, row0, m, s_sum, acc);
    }
  }
"""


# The partial kernel as it is built: its body and its header (the quantized cache's setup,
# running softmax and merges around this walk).
_BODY = shared._SETUP + _WALK + shared._BLOCK_MERGE
PARTIAL_SOURCE = "const int n_kv = k_shape[1], n_keys = k_shape[2];" + _BODY
# The same kernel over a whole cache buffer, its key count an input (``nk``, int32 [1]) rather
# than the keys' shape: its shapes then stay the same from token to token, so it can run
# inside the compiled step (``attend_counted``). The slices divide the count, not the buffer.
COUNTED_SOURCE = "const int n_kv = k_shape[1], n_keys = nk[0];" + _BODY
PARTIAL_HEADER = shared._HEADER + _HEADER


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


def _keys_per_load(dims_per_lane: int, itemsize: int) -> int:
    """Keys a lane group loads before computing: as many as the quantized kernel's load
    registers hold (each key: its row and its value row, ``dims_per_lane`` values each)."""
    words = -(-dims_per_lane * itemsize // 4)
    return max(1, min(8, shared.LANE_LOAD_REGS // (2 * words)))


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
    """The partial kernel's template constants, its slices of the keys (the grid's y) and its
    blocks for each slice (KV heads times groups of query rows, the grid's z)."""
    rows = (n_heads // n_kv) * n_q
    block_rows = shared._rows_per_block(rows)
    row_groups = rows // block_rows
    slices = max(1, min(math.ceil(shared.TARGET_BLOCKS / (b * n_kv * row_groups)), math.ceil(n_keys / MIN_SLICE)))
    lanes = shared._lanes_per_key(block_rows, d)
    template: list[tuple[str, object]] = [
        ("InT", dtype),
        ("D", d),
        ("L", n_q),
        ("REP", n_heads // n_kv),
        ("RB", block_rows),
        ("NW", shared.WARPS),
        ("LPK", lanes),
        ("KPL", _keys_per_load(d // lanes, dtype.size)),
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
        grid=(shared.WARPS * 32, slices, blocks),
        threadgroup=(shared.WARPS * 32, 1, 1),
        output_shapes=[(b * n_kv, slices, rows, d), (b * n_kv, slices, rows), (b * n_kv, slices, rows)],
        output_dtypes=[mx.float32] * 3,
    )
    merge = dict(
        template=[("InT", dtype), ("D", d), ("L", n_q), ("REP", n_heads // n_kv), ("NKV", n_kv)],
        grid=(d, rows, b * n_kv),
        threadgroup=(d, 1, 1),
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
    (out,) = shared._kernels()[1](inputs=[part_acc, part_max, part_sum], **merge)
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
    (out,) = shared._kernels()[1](inputs=[part_acc, part_max, part_sum], **merge)
    return out
