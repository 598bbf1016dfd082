"""The loaded model's KV block pool (--paged-kv): made at load, reported by /health.

The pool (engine/models/paged_kv.py) is the model's, so every chat of the host (the app's
and the server's) and every request finds the blocks the others published. Its idle
cached blocks are kept within what the memory budget leaves for KV caches beside the
weights (the default pool size without a budget).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine.models.paged_kv import CannotPage, pool_for

__all__ = ["CannotPage", "page_kv", "pool_stats"]


def page_kv(model: Any, block_size: int, allowance: int | None) -> None:
    """Give ``model`` a block pool of ``block_size``-token blocks (``CannotPage`` for a model
    with no full-attention layer to page or a length-dependent RoPE); quantized layers page
    their codes."""
    pool_for(model, block_size, allowance or None)


def pool_stats(model: Any) -> dict[str, int] | None:
    """Blocks used, shared and cached, and the pool's bytes; None when the KV is unpaged."""
    pool = getattr(model, "kv_pool", None)
    return asdict(pool.stats()) if pool is not None else None
