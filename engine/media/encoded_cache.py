"""A byte-budgeted LRU cache for encoded media (tower outputs, features).

Keys are content hashes: the file's bytes plus every setting that changes the
encoding, so the same photo sent twice, a regenerated answer, or a continued chat
reuses the encoding, while a different processor or model encodes afresh.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from engine.api import MediaInput
from engine.errors import MediaError
from engine.files import require_regular_file

T = TypeVar("T")


def content_digest(data: bytes | str | Path) -> str:
    """sha256 of the media bytes (or of the file at a path): the one read of a file for
    hashing. Keys under any settings are made from it (``media_key``)."""
    h = hashlib.sha256()
    if isinstance(data, (str, Path)):
        require_regular_file(data, "a media file", MediaError)
        with open(data, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class HashedInput(MediaInput):
    """A MediaInput whose bytes were hashed already (``digest``, by ``content_digest``):
    keys for it under any settings come without reading the file again. An input's key is
    made from the digest taken when the same request read it, so a file rewritten later is
    hashed afresh by the next request that prepares it."""

    digest: str = ""


def media_key(data: bytes | str | Path | MediaInput, settings: Mapping[str, Any] | None = None) -> str:
    """sha256 over the content digest of the media (its bytes, the file at a path, or an
    input's source; a HashedInput's own digest) and the canonical JSON of ``settings``."""
    if isinstance(data, HashedInput) and data.digest:
        digest = data.digest
    else:
        digest = content_digest(data.source if isinstance(data, MediaInput) else data)
    h = hashlib.sha256(digest.encode())
    # A separator that cannot occur in JSON text keeps the digest and settings apart.
    h.update(b"\x00settings\x00")
    h.update(json.dumps(settings or {}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def nbytes_of(value: Any) -> int:
    """Bytes held by an array (numpy or MLX), or by a tuple/list/dict of them."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (tuple, list)):
        return sum(nbytes_of(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes_of(v) for v in value.values())
    if hasattr(value, "__dataclass_fields__"):
        return sum(nbytes_of(getattr(value, name)) for name in value.__dataclass_fields__)
    return 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0


class EncodedMediaCache(Generic[T]):
    """Least-recently-used values under a total byte budget.

    ``get_or_compute(key, fn)`` returns the cached value or calls ``fn()`` and keeps
    the result, evicting the least recently used entries until it fits. A value larger
    than the whole budget is returned but not kept. Thread-safe; ``fn`` runs outside
    the lock, so two threads missing on one key may both compute it (the last one wins).
    """

    def __init__(self, max_bytes: int, sizeof: Callable[[T], int] = nbytes_of) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = int(max_bytes)
        self._sizeof = sizeof
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: str, default: T | None = None) -> T | None:
        entry = self._lookup(key)
        return default if entry is None else entry[0]

    def _lookup(self, key: str) -> tuple[T, int] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def put(self, key: str, value: T) -> bool:
        """Keep ``value``; False when it alone exceeds the budget (then nothing is stored)."""
        size = int(self._sizeof(value))
        if size < 0:
            raise ValueError(f"sizeof returned a negative size ({size})")
        with self._lock:
            self._drop(key)
            if size > self._max_bytes:
                return False
            while self._bytes + size > self._max_bytes and self._entries:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self._evictions += 1
            self._entries[key] = (value, size)
            self._bytes += size
            return True

    def get_or_compute(self, key: str, fn: Callable[[], T]) -> T:
        entry = self._lookup(key)
        if entry is not None:
            return entry[0]
        value = fn()  # an exception here leaves the cache untouched
        self.put(key, value)
        return value

    def discard(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def resize(self, max_bytes: int) -> None:
        """Change the budget, evicting least recently used entries to fit."""
        with self._lock:
            self._max_bytes = int(max_bytes)
            while self._bytes > self._max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self._evictions += 1

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, self._evictions, len(self._entries), self._bytes, self._max_bytes
            )

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]
