"""``--paged-kv`` / ``--no-paged-kv`` and ``--paged-kv-block-size N`` for generate, serve and bench.

``generate`` and ``serve`` page the KV cache by default, where the model can: measured on
the H200 at least as fast as the unpaged cache at 512 and 32k tokens (docs/paged-kv.md),
and requests and chats with a common prefix hold it once. A model that cannot page
(latent attention, a sliding window on every layer, length-dependent RoPE) loads unpaged
and says why; ``--paged-kv`` asks for paging outright (such a model is then refused) and
``--no-paged-kv`` keeps every cache its own. ``bench`` stays unpaged unless asked: its
``--paged-kv`` times paged against unpaged in one run. Requests still decode together: a
batch row gathers its blocks when it joins and writes them back when it leaves. Parsing
stays mlx-free; the block size is checked against engine.models.paged_kv when the command
runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.errors import EngineError


def add_paged_arguments(p: argparse.ArgumentParser, by_default: bool = True) -> None:
    """``by_default``: the command pages where the model can unless told not to."""
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--paged-kv",
        action="store_true",
        help="hold full-attention KV in shared blocks: chats and requests with a common prefix hold it once"
        + (" (the default where the model can; with this flag a model that cannot is refused)" if by_default else ""),
    )
    if by_default:
        which.add_argument(
            "--no-paged-kv", action="store_true", help="keep each chat's and request's KV cache its own (unpaged)"
        )
    p.add_argument(
        "--paged-kv-block-size",
        type=int,
        metavar="N",
        help="tokens per KV block when paged: 16, 32, 64, 128, 256 or 512 (default 64)",
    )
    p.set_defaults(paged_by_default=by_default)


def paged_block_size(args: Any) -> int | None:
    """The block size to page with (checked), or None when the KV stays unpaged."""
    size = getattr(args, "paged_kv_block_size", None)
    asked = getattr(args, "paged_kv", False)
    if not asked and (getattr(args, "no_paged_kv", False) or not getattr(args, "paged_by_default", False)):
        if size is not None:
            raise EngineError("--paged-kv-block-size sets how the KV pages; it cannot go with an unpaged cache")
        return None
    from engine.models.paged_kv import DEFAULT_BLOCK_SIZE, check_block_size

    return check_block_size(size) if size is not None else DEFAULT_BLOCK_SIZE


def paged_where_possible(args: Any) -> bool:
    """Whether a model that cannot page loads unpaged (the default) instead of being refused."""
    return not getattr(args, "paged_kv", False)


def page_bench_model(args: Any, model: Any) -> dict[str, int]:
    """``bench --paged-kv``: page the random model's KV (every loop of ours then reads
    blocks, the batch of ``--concurrent`` too)."""
    size = paged_block_size(args)
    assert size is not None
    from engine.models.paged_kv import pool_for

    pool_for(model, size)
    print(f"KV paged in blocks of {size} tokens", flush=True)
    return {"block_size": size}
