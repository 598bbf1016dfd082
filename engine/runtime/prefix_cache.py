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

With paged KV (``model.kv_pool``, engine/models/paged_kv.py) the prefix may also come from
the model's block pool: when the pool holds more of the prompt in published blocks than
this cache does (another chat with the same system prompt, the chat this one branched
from), the cache starts afresh holding those blocks by reference, and ``record`` publishes
this cache's full blocks for others.

A model whose RoPE follows the pass's length (dynamic NTK, LongRoPE) rotates a key by the
length of the pass that computed it. Up to its trained length (``exact_until``) every pass
rotates alike; past it, keys computed in earlier passes (the last turn's prompt, the reply's
steps) are not those one pass over the new prompt computes, as transformers does. Such a
cache is reused only while everything it ever held and the new prompt stay within that
length; past it each request is prefilled afresh (exact, at the cost of the reuse).

The chat session holds one for the target model and one for a draft model (which has no
adapters and reads media placeholders as ids).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from engine.decode.prefill import common_prefix_length
from engine.models.base import length_dependent_ropes
from engine.models.kv_cache import cache_length, checkpoint, make_prompt_cache, rewind_point, trim_prompt_cache
from engine.models.paged_kv import sequence_of


class PrefixCache:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: list[Any] | None = None
        self.ids: list[int] = []  # exactly the tokens held by self.cache
        self.keys: list[Hashable] = []  # one per cached token: its id, or a media token's content key
        self.signature = ""  # the active adapters self.cache was filled under
        # Reuse is exact only while every pass ends within this length (None: any length).
        self.exact_until = min((r.exact_until for r in length_dependent_ropes(model)), default=None)
        self.longest = 0  # the most tokens self.cache has held since it was made

    def reset(self) -> None:
        self.cache, self.ids, self.keys = None, [], []
        self.longest = 0

    def _fresh(self) -> None:
        self.cache, self.ids, self.keys = make_prompt_cache(self.model), [], []
        self.longest = 0

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
        past_exact = self.exact_until is not None and max(self.longest, len(self.ids), len(keys)) > self.exact_until
        if self.cache is None or signature != self.signature or past_exact:
            self._fresh()
            self.signature = signature
        held = self.keys if len(self.keys) == len(self.ids) else self.ids  # ids set from outside
        keep = min(common_prefix_length(held, keys), len(keys) - 1)
        for span in spans:
            if span.start < keep < span.end:
                keep = span.start
        assert self.cache is not None
        keep = rewind_point(self.cache, keep)
        pooled = self._from_pool(keys, spans, keep)
        if pooled is not None:
            keep = pooled
        else:
            drop = len(self.ids) - keep
            if trim_prompt_cache(self.cache, drop) != drop:
                self._fresh()
                keep = 0
        self.ids = list(prompt_ids[:keep])
        self.keys = list(keys[:keep])
        return keep

    def _from_pool(self, keys: Sequence[Hashable], spans: Sequence[Any], keep: int) -> int | None:
        """With paged KV: when the pool holds a longer prefix of ``keys`` than the cache
        keeps, a fresh cache holding the pool's blocks; its length (None otherwise)."""
        sequence = sequence_of(self.cache)
        if sequence is None:
            return None
        limit = len(keys) - 1
        for span in spans:  # whole blocks that end inside a media item are not taken
            if span.start < limit < span.end:
                limit = span.start
        if sequence.available(keys, self.signature, limit) <= keep:
            return None
        self._fresh()
        fresh = sequence_of(self.cache)
        assert fresh is not None
        taken = fresh.attach(keys, self.signature, limit)
        for span in spans:
            if span.start < taken < span.end:
                trim_prompt_cache(self.cache, taken - span.start)
                taken = span.start
        return taken

    def record(self, known: list[int], known_keys: list[Hashable]) -> bool:
        """After a request: note which of ``known`` (prompt + generated) the cache holds, and
        mark the end of the reply as where the next turn continues. False when the cache
        holds more than ``known`` (which tokens went in cannot be told: start afresh)."""
        if self.cache is None:
            return True
        held = cache_length(self.cache)
        if held > len(known):
            return False
        self.longest = max(self.longest, held)
        self.ids = known[:held]
        self.keys = known_keys[:held]
        checkpoint(self.cache)
        sequence = sequence_of(self.cache)
        if sequence is not None:
            # Between requests the blocks hold it all: views go first, a layer at a time, so
            # the keys and values are never held twice over every layer at once.
            sequence.drop_views()
            sequence.publish(self.keys, self.signature)
        return True
