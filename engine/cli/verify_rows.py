"""``rows_alone()``: a diagnostic in which every matmul of a pass of a few rows (a speculative
verify pass) runs one row at a time, as a one-token decode step runs it.

On the CPU build MLX's matmuls compute each row as they would alone. On CUDA they do not: a
matmul of one row runs a matrix-vector kernel (``gemv``, ``qmv``) and one of several rows a
GEMM (cuBLASLt, or the tiled quantized ``qmm``), which sum in another order, so a verify pass
rounds its rows otherwise than single steps and a bf16 near-tie can flip. Within this context
the projections (``nn.Linear``, ``nn.QuantizedLinear``, stacked projections, latent attention's
per-head products, tied output heads), DeepSeek's router and the attention of a causal pass run
row by row (each query over exactly the keys its step sees), so a pass of n rows launches what n
steps launch. Where a bench run is then identical to plain greedy and without it is not, the
row-count-dependent kernels are the whole difference; what the run costs says what exactness
would cost. Never used by decoding itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Passes of more rows (a prompt's chunks) are left as they are: only verify passes are split.
MAX_ROWS = 32


def _split(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(self, x, ...)`` once per row of ``x`` (axis -2) when it has a few, joined again."""
    import mlx.core as mx

    def rows(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        n = x.shape[-2] if x.ndim >= 2 else 1
        if not 1 < n <= MAX_ROWS:
            return fn(self, x, *args, **kwargs)
        outs = [fn(self, x[..., t : t + 1, :], *args, **kwargs) for t in range(n)]
        if isinstance(outs[0], tuple):  # a router: (experts, weights), each [..., rows, k]
            return tuple(mx.concatenate(parts, axis=-2) for parts in zip(*outs))
        return mx.concatenate(outs, axis=-2)

    return rows


def _attend_alone(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Attention of a causal pass of a few queries: each over exactly the keys its step sees."""
    import mlx.core as mx

    def attend(self: Any, q: Any, k: Any, v: Any, mask: Any) -> Any:
        n, total = q.shape[2], k.shape[2]
        if not (1 < n <= MAX_ROWS and isinstance(mask, str)):
            return fn(self, q, k, v, mask)
        ends = [total - n + t + 1 for t in range(n)]
        return mx.concatenate(
            [fn(self, q[:, :, t : t + 1], k[:, :, :e], v[:, :, :e], None) for t, e in enumerate(ends)], 2
        )

    return attend


def _latent_alone(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Latent attention's absorbed form, one query at a time over its step's latents."""
    import mlx.core as mx

    def latent_attention(self: Any, q_latent: Any, q_pe: Any, latent: Any, k_pe: Any, keep: Any, scaled: bool = False):
        n, total = q_latent.shape[2], latent.shape[2]
        if not 1 < n <= MAX_ROWS or keep is None:
            return fn(self, q_latent, q_pe, latent, k_pe, keep, scaled)
        outs = []
        for t in range(n):
            end = total - n + t + 1
            one = (q_latent[:, :, t : t + 1], q_pe[:, :, t : t + 1], latent[:, :, :end], k_pe[:, :, :end])
            outs.append(fn(self, *one, None, scaled))
        return mx.concatenate(outs, axis=2)

    return latent_attention


@contextmanager
def rows_alone() -> Iterator[None]:
    """Within: every pass of up to ``MAX_ROWS`` rows computes each row as a one-token step
    would (see the module doc). Compiled decode steps traced within keep it; trace them here."""
    import mlx.nn as nn

    from engine.models import base, mla, routed_moe, stacked

    patches = [(cls, "__call__", _split) for cls in (nn.Linear, nn.QuantizedLinear, stacked._Stack)]
    patches += [(cls, "__call__", _split) for cls in (mla.MultiLinear, mla.QuantizedMultiLinear)]
    patches += [(cls, "as_linear", _split) for cls in (nn.Embedding, nn.QuantizedEmbedding)]
    patches += [(routed_moe.GroupLimitedRouter, "__call__", _split)]
    patches += [(base.AttentionSteps, "attend", _attend_alone), (mla.MLAttention, "latent_attention", _latent_alone)]
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    try:
        for cls, name, wrap in patches:
            setattr(cls, name, wrap(cls.__dict__[name]))
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
