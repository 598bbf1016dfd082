"""Expert products of a decode step through the small-row kernel's body
(models.quantized_matmul_cuda).

``gather_quantized_matmul`` is ``mx.gather_qmm`` for a decode step's (token, expert) pairs,
each pair one row through the same body with its expert's weights; measured no faster than
MLX's on MoE shapes, it routes only when asked (``gathered_enabled``, docs/qmv.md).
"""

from __future__ import annotations

import math

import mlx.core as mx

from engine.models.kernel_switches import switch
from engine.models.quantized_matmul_cuda import WARPS, enabled, layout, rows_kernel, takes

# The most (token, expert) pairs a gathered product takes (``pays_gathered``).
MAX_PAIRS = 64
# Gathered (expert) products alone: ``1`` routes them (``gathered_enabled``).
GATHER_ENV = "MLX_DESK_GATHER_QMV"


# One row per (token, expert) pair, the pair's expert's weights (``gather_qmm``'s ``rhs_indices``)
# read from the stacked [E, N, K] arrays; pair p is blockIdx.y. Template constants as
# ``rows_product``'s with R = 1, and XS: pairs sharing one activation row (k for the gate and
# up projections, whose tokens' rows serve all k of their experts; 1 for the down projection).
_GATHER_SOURCE = """
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int pair = blockIdx.y;
  const long expert = min((int)ids[pair], w_shape[0] - 1);
  const long words = (long)N * (K / 32 * BITS);
  const long groups = (long)N * (K / GS);
  rows_product<T, 1, BITS, GS, CPW, NW, KS>(
      x + (long)(pair / XS) * K, w + expert * words, scales + expert * groups, biases + expert * groups,
      out + (long)pair * N, K, N);
"""


def gathered_enabled() -> bool:
    """Whether expert products (``gather_quantized_matmul``) are routed to the kernel: only
    with ``MLX_DESK_GATHER_QMV=1`` (on an H200 a decode step's expert products cost launch
    latency, not their weight read, and ours were no faster than MLX's: docs/qmv.md), and
    never while the kernel is off."""
    return switch(GATHER_ENV, "0") == "1" and enabled()


def gather_shares(x_batch: tuple[int, ...], ids_shape: tuple[int, ...]) -> int | None:
    """How many consecutive (token, expert) pairs share one activation row in a gathered
    product of ``x`` [*x_batch, 1, K] by the experts ``ids`` [*ids_shape]: 1 where each pair
    has its own row (a down projection's hidden rows), the experts per token where a token's
    row serves all its experts (gate and up), every pair for one row; None for other
    broadcasts (they keep MLX's kernel)."""
    pairs = math.prod(ids_shape)
    if tuple(x_batch) == tuple(ids_shape):
        return 1
    if math.prod(x_batch) == 1:
        return pairs
    if ids_shape and tuple(x_batch) == (*ids_shape[:-1], 1):
        return ids_shape[-1]
    return None


def pays_gathered(pairs: int, inputs: int, outputs: int) -> bool:
    """Whether a gathered product the kernel can take is faster through it than through
    ``mx.gather_qmm``: a decode step's or a short verify pass's pairs (each pair reads its
    expert's weights, where MLX's kernel reads an expert once for all the tokens routed to
    it, so a prompt's many pairs stay with MLX's)."""
    return pairs <= MAX_PAIRS


def gathered_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, ids: mx.array, shares: int, group_size: int, bits: int
) -> mx.array:
    """``mx.gather_qmm(x, w, ..., rhs_indices=ids, transpose=True)`` for one row per pair:
    ``x`` [..., 1, K], stacked experts ``w`` [E, N, K * bits / 32] (``scales``/``biases``
    [E, N, K / group_size]), ``ids`` [...] -> [*ids.shape, 1, N]. ``shares`` is
    ``gather_shares``'s answer; the caller checks ``fits``."""
    k, n = x.shape[-1], w.shape[1]
    pairs = ids.size
    warps, blocks = layout(k, n, bits)
    kernel = rows_kernel("gathered_quantized_matmul_rows", ("x", "w", "scales", "biases", "ids"), _GATHER_SOURCE)
    (out,) = kernel(
        inputs=[x.reshape(-1, k), w, scales, biases, ids.reshape(-1).astype(mx.uint32)],
        template=[("T", x.dtype), ("BITS", bits), ("GS", group_size), *warps, ("XS", shares)],
        grid=(blocks * WARPS * 32, pairs, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*ids.shape, 1, n)


def gather_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    ids: mx.array,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    sorted_indices: bool = False,
) -> mx.array:
    """``mx.gather_qmm(..., rhs_indices=ids, transpose=True)``, through the kernel where it is
    enabled, fits and pays (one activation row per token: decode steps and short passes)."""
    # Asked first: every expert product of every MoE step passes here, off by default.
    routed = gathered_enabled() and x.ndim >= 2 and x.shape[-2] == 1
    shares = gather_shares(x.shape[:-2], ids.shape) if routed else None
    if (
        shares is not None
        and w.ndim == 3
        and mode == "affine"  # the gathered kernel reads biases and scales in x's dtype
        and pays_gathered(ids.size, x.shape[-1], w.shape[1])
        and takes(1, x, w, scales, biases, group_size, bits, mode)
    ):
        return gathered_matmul(x, w, scales, biases, ids, shares, group_size, bits)
    return mx.gather_qmm(
        x,
        w,
        scales,
        biases,
        rhs_indices=ids,
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode,
        sorted_indices=sorted_indices,
    )
