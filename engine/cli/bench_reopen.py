"""``bench --reopen``: time to first token when a long chat reopens from its saved KV cache,
against prefilling the whole chat again (what a restart costs without saved caches).

The chat is the random prompt (``-p`` tokens); the next turn adds 16 new tokens. "prefill"
feeds all of it to an empty cache; "reopen" reads the cache saved after the chat from a
file (models.kv_cache's format, as the app writes it) and feeds only the new tokens.
"chosen" is what the engine does when a chat reopens: it weighs the file's bytes at the
disk's measured read rate against the tokens at the model's measured prefill rate
(runtime/reopen_choice.py) and takes the faster path; ``path`` in the JSON says which,
and ``raw_read_s`` is the file read sequentially once, the bar the choice is held to.
"by block" saves and reopens the same cache as the app does (runtime/saved_cache.py:
whole blocks in files of their own, the rest in the session file) and times that read too.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

NEW_TOKENS = 16


def _first_token_s(model: Any, tokens: Any, cache: list) -> float:
    import mlx.core as mx

    from engine.decode.loop import generate_step

    start = time.perf_counter()
    for token, _ in generate_step(tokens, model, cache, max_tokens=1, prefill_chunk=2048):
        mx.eval(token) if isinstance(token, mx.array) else None
        break
    return time.perf_counter() - start


def run_reopen(model: Any, prompt: Any, vocab: int, seed: int = 0) -> dict[str, Any]:
    import mlx.core as mx

    from engine.models.kv_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
    from engine.runtime.saved_cache import save_cache

    new = mx.random.randint(0, vocab, (NEW_TOKENS,), key=mx.random.key(seed + 1)).astype(mx.uint32)
    whole = mx.concatenate([prompt, new])
    # Each path runs once untimed first: MLX's CUDA build compiles kernels for each new shape
    # on first use, which once made a 1.1 s prefill time at 34 s.
    _first_token_s(model, whole, make_prompt_cache(model))
    prefill_s = _first_token_s(model, whole, make_prompt_cache(model))
    cache = make_prompt_cache(model)
    _first_token_s(model, prompt, cache)  # the chat as it was when saved
    trim = int(cache[0].offset) - int(prompt.size)  # the sampled token went in too
    if trim > 0:
        for c in cache:
            c.trim(trim)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "chat.safetensors"
        save_prompt_cache(path, cache, {})
        by_block = Path(folder) / "by-block.safetensors"
        save_cache(by_block, cache, [int(i) for i in prompt.tolist()], {"model": "bench"})
        size = path.stat().st_size
        del cache
        from engine.runtime.reopen_choice import choose, disk_read_rate, prefill_rate

        rate = disk_read_rate(path, probe=size)  # the whole file: its raw sequential read
        choice = choose(int(prompt.size), size, rate, prefill_rate(model))
        for _warm_then_timed in range(2):
            mx.clear_cache()
            start = time.perf_counter()
            restored, _ = load_prompt_cache(path)
            mx.eval([a for c in restored for a in (c.state or ())])
            load_s = time.perf_counter() - start
            reopen_s = load_s + _first_token_s(model, new, restored)
            del restored
        block_s, block_bytes = _reopen_by_block(model, by_block, new)
    chosen_s = reopen_s if choice.path == "read" else prefill_s
    print(
        f"reopen   chose to {choice.path} (estimated read {choice.read_s * 1000:.1f} ms, recompute "
        f"{choice.recompute_s * 1000:.1f} ms): first token in {chosen_s * 1000:.1f} ms; raw read "
        f"{size / rate * 1000:.1f} ms",
        flush=True,
    )
    print(
        f"reopen   {int(prompt.size):,}-token chat + {NEW_TOKENS} new: prefill all {prefill_s * 1000:9.1f} ms   "
        f"from saved cache {reopen_s * 1000:9.1f} ms (file {size / 1e6:.1f} MB read in {load_s * 1000:.1f} ms)   "
        f"{prefill_s / max(reopen_s, 1e-9):.1f}x faster",
        flush=True,
    )
    print(
        f"reopen   by block ({block_bytes / 1e6:.1f} MB in the session and block files): first token in "
        f"{block_s * 1000:.1f} ms, against {reopen_s * 1000:.1f} ms from one file",
        flush=True,
    )
    return {
        "by_block_ttft_s": block_s,
        "by_block_bytes": block_bytes,
        "prefill_ttft_s": prefill_s,
        "reopen_ttft_s": reopen_s,
        "cache_file_bytes": size,
        "cache_load_s": load_s,
        "speedup": prefill_s / max(reopen_s, 1e-9),
        "path": choice.path,
        "chosen_ttft_s": chosen_s,
        "raw_read_s": size / rate,
        "choice": choice.as_dict(),
    }


def _reopen_by_block(model: Any, path: Path, new: Any) -> tuple[float, int]:
    """Time reopening the cache saved by block at ``path`` to the first token (the second
    of two runs); the seconds and the bytes read."""
    import mlx.core as mx

    from engine.kv_files import session_bytes
    from engine.runtime.saved_cache import load_saved

    for _warm_then_timed in range(2):
        mx.clear_cache()
        start = time.perf_counter()
        restored, _ = load_saved(path)
        mx.eval([a for c in restored for a in (c.state or ())])
        seconds = time.perf_counter() - start + _first_token_s(model, new, restored)
        del restored
    return seconds, session_bytes(path)
