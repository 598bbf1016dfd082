"""``bench --shared-prefix N``: N chats that start with the same ``-p``-token prompt (a
system prompt and tools, say), each with its own 32-token question, answered one after
another, with the KV paged (``--paged-kv``) or not.

Paged, the first chat prefills the shared prompt and publishes its blocks; the others take
them from the pool and prefill only their question. Unpaged, every chat prefills it all
and holds its own copy. Reported per run: each chat's time to first token (from when the
run began: the chats are answered in turn), total generated tok/s, and the KV memory the
N chats hold at the end (MLX's active memory, the weights excluded).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from engine.errors import EngineError

QUESTION_TOKENS = 32


def add_shared_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shared-prefix",
        type=int,
        metavar="STREAMS",
        help="STREAMS chats sharing the -p token prompt, each with its own question (with or without --paged-kv)",
    )


def one_chat(model: Any, prefix: Any, question: Any, tokens: int, started: float) -> tuple[Any, float]:
    import mlx.core as mx

    from engine.decode.loop import generate_step
    from engine.runtime.prefix_cache import PrefixCache

    chat = PrefixCache(model)
    ids = [int(i) for i in mx.concatenate([prefix, question]).tolist()]
    keep = chat.reuse(ids)
    ttft = 0.0
    out: list[int] = []
    for n, (token, _) in enumerate(generate_step(mx.array(ids[keep:]), model, chat.cache, max_tokens=tokens)):
        out.append(int(token))
        if n == 0:
            ttft = time.perf_counter() - started
    chat.record(ids + out, ids + out)
    return chat, ttft


def run_shared(args: argparse.Namespace, model: Any, vocab: int, prefix: Any) -> dict[str, Any]:
    import mlx.core as mx

    streams = args.shared_prefix
    if not 1 <= streams <= 256:
        raise EngineError(f"--shared-prefix takes 1 to 256 streams (got {streams})")
    questions = [
        mx.random.randint(0, vocab, (QUESTION_TOKENS,), key=mx.random.key(1000 + i)).astype(mx.uint32)
        for i in range(streams)
    ]
    mx.clear_cache()
    before = mx.get_active_memory()
    # One untimed chat first: kernels compiled for the shapes (and, paged, the shared
    # prompt published, as a server that has answered once holds it: counted in the KV held).
    one_chat(model, prefix, questions[0], 2, time.perf_counter())
    started = time.perf_counter()
    chats, ttfts = [], []
    for question in questions:
        chat, ttft = one_chat(model, prefix, question, args.generation_tokens, started)
        chats.append(chat)
        ttfts.append(ttft)
    total_s = time.perf_counter() - started
    mx.clear_cache()
    held = mx.get_active_memory() - before
    pool = getattr(model, "kv_pool", None)
    out = {
        "streams": streams,
        "shared_tokens": int(prefix.size),
        "ttft_s": ttfts,
        "mean_ttft_s": sum(ttfts) / streams,
        "total_tps": streams * args.generation_tokens / total_s,
        "kv_bytes_held": held,
        "paged": pool is not None,
        "pool": vars(pool.stats()) if pool is not None else None,
    }
    print(
        f"shared   {streams} chats x {int(prefix.size):,}-token prompt + {QUESTION_TOKENS} "
        f"({'paged' if pool is not None else 'unpaged'}): first token {ttfts[0] * 1000:.1f} ms, mean "
        f"{out['mean_ttft_s'] * 1000:.1f} ms; {out['total_tps']:.1f} tok/s in all; KV held "
        f"{held / 1e6:.1f} MB",
        flush=True,
    )
    del chats
    return out
