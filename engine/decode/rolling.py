"""A rolling window that slides during the reply, as LM Studio's "rolling window" does: when
the reply fills the model's context, the oldest tokens are dropped (all but the first few,
the system prompt or attention-sink tokens) and generation goes on.

How the kept tokens get back into the cache: they are prefilled afresh. The sink keeps its
keys and values (it comes first either way, so they are what a fresh prefill computes); the
rest of the window is prefilled again after it. The cheaper alternative, shifting the cached
keys to their new positions by a RoPE rotation, is not exact: every layer above the first
computed its keys and values while attending to the tokens now dropped, so a shifted cache
is not the cache of the kept tokens. Re-prefilling is: the reply goes on exactly as a fresh
prefill of the kept window followed by decoding would. It costs one prefill of three
quarters of the context each time the window slides, which is every quarter of a context
of reply.

Only caches whose every layer can be trimmed back to the sink take part (full attention,
quantized or latent KV); sliding-window and recurrent layers keep stopping at the limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from engine.models.kv_cache import cache_length, can_trim_prompt_cache, trim_prompt_cache

SINK_TOKENS = 4  # kept at the start when there is no system prompt (attention sinks)

TokenStream = Iterator[tuple[int, float | None]]


def can_slide(cache: Sequence[Any]) -> bool:
    """Whether every layer is a plain KV cache that can go back to any length."""
    return (
        bool(cache)
        and can_trim_prompt_cache(list(cache))
        and not any(hasattr(c, "nearest") or hasattr(c, "max_size") for c in cache)
    )


class RollingWindow:
    """Where a sliding reply stands: the ids the cache was last refilled with."""

    def __init__(self, limit: int, sink: int) -> None:
        self.limit = limit
        self.sink = max(0, sink)
        self.held: list[int] | None = None  # after a slide: the kept window prefilled afresh
        self.since = 0  # reply tokens generated before the last slide
        self.slides = 0

    def _sizes(self) -> tuple[int, int]:
        """(ids kept at a slide, of which the sink): a quarter of the context is left free."""
        keep = self.limit - max(1, self.limit // 4)
        return keep, min(self.sink, keep // 2)

    def kept(self, ids: Sequence[int]) -> list[int]:
        """The window kept from ``ids`` (prompt and reply so far): the sink, then the latest
        tokens, leaving a quarter of the context free for the reply to go on."""
        keep, sink = self._sizes()
        return list(ids[:sink]) + list(ids[len(ids) - (keep - sink) :])

    def still_read(self, prompt_length: int) -> tuple[int, int] | None:
        """After a slide: (the sink's length, where the latest tokens kept begin), positions
        in the prompt's and reply's ids; the model reads nothing in between any more. None
        while the window has not slid."""
        if self.held is None:
            return None
        keep, sink = self._sizes()
        return sink, prompt_length + self.since - (keep - sink)

    def cache_ids(self, prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
        """The ids the cache holds the keys and values of, in order, once the reply is done."""
        if self.held is None:
            return list(prompt_ids) + list(generated)
        return self.held + list(generated[self.since :])


def rolling_tokens(
    window: RollingWindow,
    context_ids: Sequence[int],
    max_tokens: int,
    first: TokenStream,
    restart: Callable[[list[int], int, int], TokenStream],
    cache: list[Any],
    cancel: threading.Event | None = None,
) -> TokenStream:
    """Tokens from ``first`` (a decode stream over ``context_ids`` that stops at the context),
    then, each time the context is full, from ``restart(kept, cached, room)``: a new stream
    over the kept window whose first ``cached`` ids are still in ``cache``, for up to ``room``
    tokens. Stops after ``max_tokens`` in all."""
    ids = list(context_ids)
    produced = 0
    stream = first
    while True:
        for token, lp in stream:
            ids.append(token)
            produced += 1
            yield token, lp
        if produced >= max_tokens or (cancel is not None and cancel.is_set()):
            return
        kept = window.kept(ids)
        sink = min(window.sink, len(kept) - 1)
        while sink > 0 and kept[:sink] != ids[:sink]:
            sink -= 1
        drop = cache_length(cache) - sink
        if trim_prompt_cache(cache, drop) != drop:  # cannot happen for can_slide caches
            return
        window.held, window.since = kept, produced
        window.slides += 1
        stream = restart(kept, sink, min(max_tokens - produced, window.limit - len(kept)))
