"""PrefixCache: one model's KV cache and exactly the ids it holds, reused by prefix.

A request's prompt is compared with the ids the cache holds; the longest common prefix is
kept (the cache trimmed back to it) and only the rest is prefilled. Ids are compared
through per-token keys when the caller has them (a media token's key names the media's
content, so two different photos never share a prefix although their ids agree), and a
kept prefix never ends inside a media item (``spans``). Recurrent layers go back only to
the snapshots taken at turn boundaries (``rewind_point``); a cache that cannot be trimmed
far enough (a sliding window that has rotated past the point) is built afresh.

The cache is keyed on the adapters it was filled under (``signature``): keys and values
computed under one adapter set are never reused under another.

The chat session holds one for the target model and one for a draft model (which has no
adapters and reads media placeholders as ids).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from engine.models.kv_cache import cache_length, checkpoint, make_prompt_cache, rewind_point, trim_prompt_cache


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: list[Any] | None = None
        self.ids: list[int] = []  # exactly the tokens held by self.cache
        self.keys: list[Hashable] = []  # one per cached token: its id, or a media token's content key
        self.signature = ""  # the active adapters self.cache was filled under

    def reset(self) -> None:
        self.cache, self.ids, self.keys = None, [], []

    def _fresh(self) -> None:
        self.cache, self.ids, self.keys = make_prompt_cache(self.model), [], []

    def reuse(
        self,
        prompt_ids: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        spans: Sequence[Any] = (),
        signature: str = "",
    ) -> int:
        """Bring the cache to the longest prefix it shares with ``keys`` (default: the ids),
        leaving at least one token to feed, whose logits start generation, and never ending
        inside a media item; return its length."""
        keys = list(prompt_ids) if keys is None else keys
        if self.cache is None or signature != self.signature:
            self._fresh()
            self.signature = signature
        held = self.keys if len(self.keys) == len(self.ids) else self.ids  # ids set from outside
        keep = min(common_prefix_length(held, keys), len(keys) - 1)
        for span in spans:
            if span.start < keep < span.end:
                keep = span.start
        assert self.cache is not None
        keep = rewind_point(self.cache, keep)
        drop = len(self.ids) - keep
        if trim_prompt_cache(self.cache, drop) != drop:
            self._fresh()
            keep = 0
        self.ids = list(prompt_ids[:keep])
        self.keys = list(keys[:keep])
        return keep

    def record(self, known: list[int], known_keys: list[Hashable]) -> bool:
        """After a request: note which of ``known`` (prompt + generated) the cache holds, and
        mark the end of the reply as where the next turn continues. False when the cache
        holds more than ``known`` (which tokens went in cannot be told: start afresh)."""
        if self.cache is None:
            return True
        held = cache_length(self.cache)
        if held > len(known):
            return False
        self.ids = known[:held]
        self.keys = known_keys[:held]
        checkpoint(self.cache)
        return True
