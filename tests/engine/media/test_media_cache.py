"""The encoded-media cache: content keys, LRU order under a byte budget, size accounting."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from engine.media.encoded_cache import EncodedMediaCache, media_key, nbytes_of
from engine.media.image import Gemma3ImageProcessor, load_image


def arr(n_bytes: int, fill: float = 0.0) -> np.ndarray:
    return np.full(n_bytes // 4, fill, dtype=np.float32)


def test_media_key_depends_on_bytes_and_settings_only(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"pixels" * 1000)
    settings = {"processor": "gemma3", "size": 896, "mean": [0.5, 0.5, 0.5]}
    k = media_key(path, settings)
    assert k == media_key(b"pixels" * 1000, dict(reversed(list(settings.items()))))  # path == bytes, order-free
    assert len(k) == 64 and int(k, 16) >= 0
    assert k != media_key(b"pixels" * 1000, {**settings, "size": 448})
    assert k != media_key(b"pixels" * 999 + b"pixelz", settings)
    assert media_key(b"x") != media_key(b"x", {"a": 1})


def test_lru_eviction_follows_use_order():
    cache = EncodedMediaCache(max_bytes=100)
    cache.put("a", arr(40))
    cache.put("b", arr(40))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", arr(40))  # 120 > 100: evicts b, the least recently used
    assert "a" in cache and "c" in cache and "b" not in cache
    s = cache.stats()
    assert (s.entries, s.bytes, s.evictions, s.hits) == (2, 80, 1, 1)


def test_get_or_compute_computes_once_and_counts():
    cache = EncodedMediaCache(max_bytes=1000)
    calls = []

    def encode():
        calls.append(1)
        return arr(64, 3.0)

    first = cache.get_or_compute("k", encode)
    second = cache.get_or_compute("k", encode)
    assert second is first and len(calls) == 1
    s = cache.stats()
    assert (s.hits, s.misses, s.bytes) == (1, 1, 64)


def test_values_larger_than_the_budget_are_returned_but_not_kept():
    cache = EncodedMediaCache(max_bytes=50)
    cache.put("small", arr(40))
    big = cache.get_or_compute("big", lambda: arr(400))
    assert big.nbytes == 400
    assert "big" not in cache and "small" in cache  # nothing was evicted for it
    assert cache.stats().bytes == 40


def test_failed_computation_caches_nothing():
    cache = EncodedMediaCache(max_bytes=1000)

    def boom():
        raise RuntimeError("tower failed")

    with pytest.raises(RuntimeError):
        cache.get_or_compute("k", boom)
    assert "k" not in cache and cache.stats().bytes == 0


def test_replacing_discarding_resizing_and_clearing_keep_the_books_right():
    cache = EncodedMediaCache(max_bytes=1000)
    cache.put("a", arr(100))
    cache.put("a", arr(200))  # replace: size accounted once
    cache.put("b", arr(300))
    assert cache.stats().bytes == 500 and len(cache) == 2
    cache.discard("a")
    assert cache.stats().bytes == 300
    cache.put("c", arr(400))
    cache.resize(450)  # b is older than c
    assert "b" not in cache and "c" in cache and cache.stats().bytes == 400
    cache.clear()
    assert len(cache) == 0 and cache.stats().bytes == 0


def test_none_is_a_cacheable_value():
    cache = EncodedMediaCache(max_bytes=10)
    calls = []
    assert cache.get_or_compute("n", lambda: calls.append(1)) is None
    assert cache.get_or_compute("n", lambda: calls.append(1)) is None
    assert len(calls) == 1


def test_sizes_of_composite_values():
    @dataclass
    class Encoded:
        features: np.ndarray
        grid: np.ndarray
        note: str = "x"

    value = Encoded(arr(64), np.zeros(3, dtype=np.int64))
    assert nbytes_of(value) == 64 + 24
    assert nbytes_of((arr(8), [arr(4)], {"k": arr(12)})) == 24
    cache = EncodedMediaCache(max_bytes=100, sizeof=lambda v: len(v))
    cache.put("s", "abcde")
    assert cache.stats().bytes == 5


def test_concurrent_use_keeps_accounting_consistent():
    cache = EncodedMediaCache(max_bytes=4000)

    def worker(seed: int):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            key = f"k{rng.integers(0, 40)}"
            cache.get_or_compute(key, lambda: arr(int(rng.integers(1, 40)) * 4))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert s.bytes <= 4000
    assert s.bytes == sum(nbytes_of(cache.get(f"k{i}")) for i in range(40) if f"k{i}" in cache)


def test_reencoding_a_resent_photo_is_avoided(shared_data):
    """The intended use: key by file content and processor settings, encode once."""
    path = shared_data / "images" / "chelsea.png"
    proc = Gemma3ImageProcessor(size=224)
    cache = EncodedMediaCache(max_bytes=8 * 1024 * 1024)
    encodes = []

    def encode():
        encodes.append(1)
        return proc([load_image(path)])

    first = cache.get_or_compute(media_key(path, proc.settings()), encode)
    again = cache.get_or_compute(media_key(path.read_bytes(), proc.settings()), encode)
    assert again is first and len(encodes) == 1 and first.shape == (1, 3, 224, 224)
    other = Gemma3ImageProcessor(size=112)
    cache.get_or_compute(media_key(path, other.settings()), lambda: other([load_image(path)]))
    assert len(cache) == 2
