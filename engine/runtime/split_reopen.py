"""Reopening a saved chat both ways at once: prefill its first tokens while the saved keys
and values of the rest are read from the file.

The keys and values a saved cache holds at positions k..n are what a prefill of the whole
chat computes there (the file was written from one), and prefilling positions 0..k
computes the same keys and values there. So the two parts can come from two places at
the same time: the engine thread prefills the first k tokens while reader threads read
every layer's rows k..n from the file, and the rows read are appended to the prefilled
cache. The first token then comes after max(prefill(k), read(n - k)), least where the two
are equal (``reopen_choice.split_point``): sooner than reading it all or prefilling it all
whenever each of those takes time.

A layer's keys are stored [1, heads, tokens, dim], so one head's rows k..n are one byte
range: a layer is read in 2 x heads ranges, straight into the array that becomes the rows
(``os.preadv``), several layers at once.

It applies where every layer keeps a plain full-attention cache (``KVCache``, or a paged
one), saved at full precision, and the RoPE does not depend on the pass's length; any
other chat reopens by reading or by recomputing (runtime/reopen_choice.py).
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

_HEADER_LIMIT = 64 << 20  # a safetensors header past this is not one of ours
READERS = 4  # layers read at once: enough to keep a fast disk's queue full
PREFILL_CHUNK = 512
SPLIT_KINDS = ("KVCache", "PagedKVCache")
# safetensors dtype -> (numpy dtype holding its bits, MLX dtype to view them as; None: the same)
DTYPES = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, "bfloat16")}


def read_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """A saved cache's safetensors header and where its data starts (ValueError when it is
    not a header of ours)."""
    with open(path, "rb") as f:
        try:
            (length,) = struct.unpack("<Q", f.read(8))
        except struct.error as exc:
            raise ValueError("no safetensors header") from exc
        if length > _HEADER_LIMIT:
            raise ValueError("a header too large for a saved cache")
        return json.loads(f.read(length)), 8 + length


def splittable(path: str | Path, model: Any) -> bool:
    """Whether a chat saved in ``path`` can reopen split (see the module's docstring)."""
    from engine.models.kv_cache import KVCache, make_prompt_cache
    from engine.models.paged_kv import PagedKVCache

    if any(getattr(m, "length_dependent", False) for _, m in model.named_modules()):
        return False
    if not all(type(c) in (KVCache, PagedKVCache) for c in make_prompt_cache(model)):
        return False
    try:
        header, _ = read_header(path)
        layers = json.loads(header["__metadata__"]["layers"])
        return all(
            layer["kind"] in SPLIT_KINDS and int(layer["arrays"]) == 2 and header[f"{i}.0"]["dtype"] in DTYPES
            for i, layer in enumerate(layers)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _read_rows(fd: int, entry: dict[str, Any], base: int, start: int) -> np.ndarray:
    """Positions ``start``.. of one saved [1, heads, tokens, dim] array, read head by head."""
    _, heads, tokens, dim = entry["shape"]
    bits, _ = DTYPES[entry["dtype"]]
    rows = np.empty((1, heads, tokens - start, dim), bits)
    item = rows.itemsize
    view = memoryview(rows.reshape(-1).view(np.uint8))
    span = (tokens - start) * dim * item
    begin = base + entry["data_offsets"][0]
    for h in range(heads):
        at, done = begin + (h * tokens + start) * dim * item, 0
        while done < span:  # a read may return short (a signal, a network disk)
            n = os.preadv(fd, [view[h * span + done : (h + 1) * span]], at + done)
            if n <= 0:
                raise OSError(f"the file ends before head {h}'s rows")
            done += n
    return rows


def read_tail(path: str | Path, start: int, pool: ThreadPoolExecutor) -> Any:
    """Start reading every layer's keys and values from position ``start`` on; a future of
    [(keys, values), ...] as numpy arrays (the header's dtypes)."""
    header, base = read_header(path)
    count = len(json.loads(header["__metadata__"]["layers"]))
    fd = os.open(path, os.O_RDONLY)

    def layer(i: int) -> tuple[np.ndarray, np.ndarray]:
        return _read_rows(fd, header[f"{i}.0"], base, start), _read_rows(fd, header[f"{i}.1"], base, start)

    jobs = [pool.submit(layer, i) for i in range(count)]

    def gather() -> list[tuple[np.ndarray, np.ndarray]]:
        try:
            return [job.result() for job in jobs]
        finally:
            os.close(fd)

    return gather, header


def _as_mlx(rows: np.ndarray, entry: dict[str, Any]) -> Any:
    import mlx.core as mx

    _, view = DTYPES[entry["dtype"]]
    array = mx.array(rows)
    return array.view(getattr(mx, view)) if view else array


def split_cache(path: str | Path, model: Any, ids: list[int], split_at: int) -> list:
    """The cache of the chat saved in ``path`` (its ``ids``): the first ``split_at`` tokens
    prefilled while the rest is read. Raises OSError or ValueError on a file that cannot
    give its rows."""
    import mlx.core as mx

    from engine.decode.prefill import prefill
    from engine.models.kv_cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with ThreadPoolExecutor(READERS) as pool:
        gather, header = read_tail(path, split_at, pool)
        prefill(model, mx.array(ids[:split_at], dtype=mx.uint32), cache, chunk=PREFILL_CHUNK)
        tail = gather()
    for i, (c, (keys, values)) in enumerate(zip(cache, tail, strict=True)):
        c.update_and_fetch(_as_mlx(keys, header[f"{i}.0"]), _as_mlx(values, header[f"{i}.1"]))
    mx.eval([a for c in cache for a in (c.state or ())])
    return cache


def restore_split(path: str | Path, chat: Any, identity: dict[str, str], split_at: int) -> tuple[int, str]:
    """``chat``'s cache from ``path`` by ``split_cache`` (``restore_session``'s contract:
    tokens restored, or 0 and why)."""
    try:
        header, _ = read_header(path)
        meta = header["__metadata__"]
        ids = [int(i) for i in json.loads(meta["user.token_ids"])]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return 0, _unreadable(exc)
    for key, value in identity.items():  # saved_cache.IDENTITY_KEYS, as restore_session checks them
        if meta.get(f"user.{key}", "") != value:
            return 0, f"the saved cache was made with another {key}"
    if not 0 < split_at < len(ids) or header.get("0.0", {}).get("shape", [0, 0, 0])[2] != len(ids):
        return 0, "the saved cache does not match its token ids"
    try:
        cache = split_cache(path, chat.model, ids, split_at)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return 0, _unreadable(exc)
    chat.reset()
    chat.cache, chat.ids, chat.token_keys = cache, list(ids), list(ids)
    chat.signature = identity["adapters"]
    return len(ids), ""


def _unreadable(exc: Exception) -> str:
    return f"the saved cache is unreadable ({' '.join(str(exc).split())[:200]})"
