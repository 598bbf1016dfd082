"""``--paged-kv [--paged-kv-block-size N]`` for generate, serve and bench.

Off by default until it decodes at least as fast as the unpaged cache on the machines we
measure (docs/paged-kv.md). Requests still decode together: a batch row gathers its
blocks when it joins and writes them back when it leaves. Parsing stays mlx-free; the
block size is checked against engine.models.paged_kv when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.errors import EngineError


def add_paged_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--paged-kv",
        action="store_true",
        help="hold full-attention KV in shared blocks: chats and requests with a common prefix hold it once",
    )
    p.add_argument(
        "--paged-kv-block-size",
        type=int,
        metavar="N",
        help="tokens per KV block with --paged-kv: 16, 32, 64, 128, 256 or 512 (default 64)",
    )


def paged_block_size(args: Any) -> int | None:
    """The block size asked for (checked), or None when the KV stays unpaged."""
    size = getattr(args, "paged_kv_block_size", None)
    if not getattr(args, "paged_kv", False):
        if size is not None:
            raise EngineError("--paged-kv-block-size needs --paged-kv")
        return None
    from engine.models.paged_kv import DEFAULT_BLOCK_SIZE, check_block_size

    return check_block_size(size) if size is not None else DEFAULT_BLOCK_SIZE


def page_bench_model(args: Any, model: Any) -> dict[str, int]:
    """``bench --paged-kv``: page the random model's KV (every loop of ours then reads
    blocks, the batch of ``--concurrent`` too)."""
    size = paged_block_size(args)
    assert size is not None
    from engine.models.paged_kv import pool_for

    pool_for(model, size)
    print(f"KV paged in blocks of {size} tokens", flush=True)
    return {"block_size": size}
