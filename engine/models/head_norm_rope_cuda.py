"""The attention heads of a decode step from its stacked q/k/v product in one CUDA kernel:
queries and keys normed per head (where the family norms them, as Qwen3 does) and rotated,
and values, in the [B, heads, L, head_dim] layout attention reads (keys and values stacked in
one array, which a KV cache of one buffer writes with one update). For decode steps, verify
passes and batch steps.

A Qwen3 layer's queries and keys each take ``rms_norm`` over every head and then RoPE: four
launches a layer, each a few microseconds of host and device time around a few KB of work;
a Llama layer's take one RoPE launch. Around them sit the views that split the product into
heads and move them to attention's layout (a reshape, three slices, two transposes a layer):
not kernels, but nodes the host builds and hands over every step like any op (cheap ones on
the GPU machine, measured in docs/qmv.md). So all of it is one kernel: a warp per (token,
head) reads the head's features from the product as it is, norms them, scales them by the
norm's weight and rotates them (queries and keys), or moves them (values).

The kernel computes what ``mx.fast.rms_norm`` then ``mx.fast.rope`` compute on CUDA, rounding
where they round: the norm's output is ``weight * round(x * rsqrt(mean(x^2) + eps))`` in the
activations' dtype (MLX multiplies in that dtype), and the rotation of pair (i, i + d/2) uses
``theta = scale * position * 2^(-(i / (d/2)) * log2(base))`` in float32. What differs: the
sum of squares is added in another order (a warp's shuffle, not MLX's block reduction), and
cos, sin and exp2 may differ in their last float32 bits; in bfloat16 and float16 at least
99% of the outputs are MLX's bit for bit on the H200 and the rest one rounding apart.
tests/engine/models/test_qmv_emulated.py runs this source on the CPU as well.

Taken (``fits``) only where MLX's CUDA backend runs on the GPU, for the plain rotate-half RoPE
over the whole head (no frequency table, no output scale), no norms or the plain
``nn.RMSNorm`` with one eps for both, heads of 64, 128 or 256 features, a few rows (decode,
verify, batch steps), and weights in the activations' dtype; ``MLX_DESK_QK_ROPE=0`` turns it off. Everything
else keeps MLX's calls.
"""

from __future__ import annotations

import math
import struct
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import l2_ahead_cuda
from engine.models.cuda_build import cuda_kernel
from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_cuda import available, compact

ENV = "MLX_DESK_QK_ROPE"
HEAD_DIMS = (64, 128, 256)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The most rows (tokens of all sequences) a pass may have to take the kernel: decode and
# batch steps and verify passes; a prompt keeps MLX's calls.
MAX_ROWS = 64
# Warps per block: one (token, head) each.
WARPS = 4

# The source in parts: ``_NORM`` only for families with per-head norms (Qwen3); without it the
# features go to RoPE as they are (Llama and most others).
_HEAD = """
// One warp per (token, head) of the queries, keys and values; lane l holds features l + 32 j.
constexpr int PER = D / 32;
constexpr int HALF = PER / 2;  // feature l + 32 j pairs with l + 32 (j + HALF)
const int lane = threadIdx.x & 31;
const int item = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
const int rows = B * L;
if (item >= rows * (NQ + 2 * NKV)) return;
const int row = item / (NQ + 2 * NKV);
const int head = item % (NQ + 2 * NKV);
const int b = row / L;
const int t = row % L;
const T* src = x + ((long)row * (NQ + 2 * NKV) + head) * D;
if (head >= NQ + NKV) {  // a value head: moved to the attention layout as it is (kv[1])
  T* dst = kv + (((long)(B + b) * NKV + head - NQ - NKV) * L + t) * D;
#pragma unroll
  for (int j = 0; j < PER; ++j) dst[lane + 32 * j] = src[lane + 32 * j];
  return;
}
float y[PER];
#pragma unroll
for (int j = 0; j < PER; ++j) y[j] = static_cast<float>(src[lane + 32 * j]);
"""

_NORM = """
float squares = 0.f;
#pragma unroll
for (int j = 0; j < PER; ++j) squares += y[j] * y[j];
#pragma unroll
for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
const float norm = rsqrt(squares / D + EPS);
// The norm's output in the activations' dtype: the weight times the normed value rounded to
// that dtype, the product rounded once more (MLX's kernel multiplies the two in the dtype; a
// product of two such values is exact in float32), then RoPE on it in float32 as MLX's does.
const T* weight = head < NQ ? q_weight : k_weight;
#pragma unroll
for (int j = 0; j < PER; ++j) {
  const float normed = static_cast<float>(static_cast<T>(y[j] * norm));
  y[j] = static_cast<float>(static_cast<T>(static_cast<float>(weight[lane + 32 * j]) * normed));
}
"""

_ROPE = """
const int position = t + static_cast<int>(offset[OFFSETS > 1 ? b : 0]);
const float angle = SCALE * static_cast<float>(position);
T* dst = head < NQ ? q + (((long)b * NQ + head) * L + t) * D : kv + (((long)b * NKV + head - NQ) * L + t) * D;
#pragma unroll
for (int j = 0; j < HALF; ++j) {
  const int i = lane + 32 * j;
  const float d = static_cast<float>(i) / static_cast<float>(D / 2);
  const float theta = angle * exp2(-d * LOG2_BASE);
  const float c = cos(theta);
  const float s = sin(theta);
  const float x1 = y[j];
  const float x2 = y[j + HALF];
  dst[i] = static_cast<T>(x1 * c - x2 * s);
  dst[i + D / 2] = static_cast<T>(x1 * s + x2 * c);
}
"""


def source(normed: bool) -> str:
    """The kernel's body, with the per-head norms or without."""
    return _HEAD + (_NORM if normed else "") + _ROPE


def kernel_source(normed: bool, eps: float, scale: float, log2_base: float, ahead: int = 0) -> str:
    """The whole body MLX builds for one model's constants (written into it as float32 values,
    as MLX passes them to its own kernels); with ``ahead`` arrays (inputs a0, a1, ...) asked
    into L2 first (models.l2_ahead_cuda: the products after attention read them)."""
    prefetch = compact(l2_ahead_cuda.prefetch_source(ahead)) if ahead else ""
    return constants(eps, scale, log2_base) + prefetch + compact(source(normed))


@cache
def _kernel(normed: bool, eps: float, scale: float, log2_base: float, ahead: int = 0):
    weights = ["q_weight", "k_weight"] if normed else []
    return cuda_kernel(
        name="head_norm_rope" if normed else "head_rope",
        input_names=["x", *weights, "offset", *(f"a{i}" for i in range(ahead))],
        output_names=["q", "kv"],
        source=kernel_source(normed, eps, scale, log2_base, ahead),
    )


def constants(eps: float, scale: float, log2_base: float) -> str:
    """The source lines that give the kernel its float constants."""
    return "".join(
        f"constexpr float {name} = static_cast<float>({value.hex()});\n"
        for name, value in (("EPS", eps), ("SCALE", scale), ("LOG2_BASE", log2_base))
    )


def enabled() -> bool:
    """Whether the kernel may run: not turned off (``MLX_DESK_QK_ROPE=0``) and MLX's CUDA
    backend on the GPU."""
    return switch(ENV, "1") != "0" and available()


def fits(attn: Any, y: mx.array, plain_rope: bool) -> bool:
    """Whether ``attn``'s norms (where it has them) and rotation of its stacked q/k/v product
    ``y`` [B, L, (nq + 2 nkv) * d] are the kernel's (see the module docstring); ``plain_rope``:
    whether ``attn.rope`` is the plain RoPE class (no subclass that picks its settings by
    position)."""
    rope = attn.rope
    d = attn.head_dim
    if y.ndim != 3 or y.shape[2] != (attn.n_heads + 2 * attn.n_kv_heads) * d:
        return False
    norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if attn.qk_norm else ()
    return (
        plain_rope
        and all(type(norm) is nn.RMSNorm and norm.weight.dtype == y.dtype for norm in norms)
        and (not norms or norms[0].eps == norms[1].eps)
        and rope._freqs is None
        and rope.base is not None
        and rope.out_scale == 1.0
        and not rope.traditional
        and rope.dims == d
        and d in HEAD_DIMS
        and y.dtype in DTYPES
        and y.shape[0] * y.shape[1] <= MAX_ROWS
    )


def head_norm_rope(attn: Any, y: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
    """Queries [B, nq, L, d], normed where ``attn`` norms its heads and rotated, and keys and
    values stacked [2, B, nkv, L, d] (keys rotated), from the stacked q/k/v product ``y`` [B,
    L, (nq + 2 nkv) * d], read as it is (no views before the launch): the stack is what a KV
    cache of one buffer writes with one update. ``offset`` is the first token's position (an
    int, a scalar array, or one per sequence, as ``mx.fast.rope`` takes it). The caller checks
    ``fits``."""
    b, n, _ = y.shape
    nq, nkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    rope = attn.rope
    positions = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
    items = b * n * (nq + 2 * nkv)
    normed = bool(attn.qk_norm)
    eps = float(attn.q_norm.eps) if normed else 0.0
    weights = [attn.q_norm.weight, attn.k_norm.weight] if normed else []
    ahead = l2_ahead_cuda.take()
    kernel = _kernel(normed, eps, float(rope.scale), log2_float32(rope.base), len(ahead))
    q, kv = kernel(
        inputs=[y, *weights, positions, *ahead],
        template=[
            ("T", y.dtype),
            ("B", b),
            ("L", n),
            ("NQ", nq),
            ("NKV", nkv),
            ("D", d),
            ("OFFSETS", positions.size),
            *(l2_ahead_cuda.constants(ahead) if ahead else ()),
        ],
        grid=(-(-items // WARPS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(b, nq, n, d), (2, b, nkv, n, d)],
        output_dtypes=[y.dtype] * 2,
    )
    return q, kv


def log2_float32(base: float) -> float:
    """log2 of the RoPE base as MLX's kernel gets it: the base held as a float32, its log2
    (here in double, there in float32: within one float32 rounding)."""
    return math.log2(struct.unpack("f", struct.pack("f", base))[0])
