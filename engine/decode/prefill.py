"""Chunked prefill: feeding a prompt into the cache before the first token.

``PromptInputs`` carries what a multimodal prompt adds to the ids (spliced embeddings,
mRoPE positions, bidirectional image blocks); ``prefill`` feeds the ids chunk by chunk,
evaluating only the cache, and stops between chunks when cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.models.base import length_dependent_ropes

ProgressCallback = Callable[[int, int], None]

# How far back logits processors (repetition penalty) may look.
HISTORY_WINDOW = 1024


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, or their per-token keys)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cache_arrays(cache: Sequence[Any]) -> list[Any]:
    """What a chunk evaluates: each layer's arrays. A paged layer names its view and blocks
    (``pending_arrays``): its ``state`` gathers every block into a new array, which made each
    chunk copy the whole cache (a 32k-token prompt prefilled 8x slower paged on the H200)."""
    return [c.pending_arrays() if hasattr(c, "pending_arrays") else c.state for c in cache]


@dataclass
class PromptInputs:
    """What a multimodal prompt adds to the ids not yet in the cache.

    ``embeddings`` (L, hidden) are the token embeddings with media features spliced in;
    ``positions`` (3, L) are position ids for multimodal RoPE (Qwen2.5-VL), and decode
    steps continue at cache offset + ``position_delta``; ``blocks`` are [start, end)
    runs (one image each) whose tokens attend to each other both ways (Gemma 3), which
    a prefill chunk therefore never splits. Offsets are into the fed ids.
    """

    embeddings: mx.array | None = None
    positions: mx.array | None = None
    position_delta: int = 0
    blocks: list[tuple[int, int]] = field(default_factory=list)

    def kwargs(self, start: int, end: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.embeddings is not None:
            out["input_embeddings"] = self.embeddings[None, start:end]
        if self.positions is not None:
            out["position_ids"] = self.positions[:, None, start:end]
        inside = [(max(s, start) - start, min(e, end) - start) for s, e in self.blocks if s < end and e > start]
        if inside:
            out["bidirectional"] = inside
        return out

    def decode_kwargs(self, cache: Sequence[Any]) -> dict[str, Any]:
        if self.positions is None:
            return {}
        pos = int(cache[0].offset) + self.position_delta
        return {"position_ids": mx.full((3, 1, 1), pos, dtype=mx.int32)}

    def chunk_end(self, start: int, end: int) -> int:
        """Move a chunk's end off the inside of a block: back to its start, or (when the
        block begins the chunk) forward to its end."""
        for s, e in self.blocks:
            if s < end < e:
                return s if s > start else e
        return end


def prefill(
    model: Any,
    prompt: mx.array,
    cache: Sequence[Any],
    *,
    chunk: int,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    inputs: PromptInputs | None = None,
    trailing: int = 0,
) -> bool:
    """Feed ``prompt`` (1-D ids) into ``cache`` in chunks. Only the cache is evaluated,
    never the logits of the chunk. Returns False when cancelled between chunks.

    ``trailing``: ids of the same prompt fed right after (the last one, whose logits start
    generation). RoPE that follows the pass's length (dynamic NTK, LongRoPE) rotates every
    chunk as transformers' one pass over the whole prompt does, not by each chunk's end."""
    total = int(prompt.size)
    chunk = max(1, chunk)
    ropes = length_dependent_ropes(model)
    for rope in ropes:
        rope.pass_end = (int(cache[0].offset) if cache else 0) + total + trailing
    try:
        return _feed(model, prompt, cache, chunk, cancel, on_progress, inputs)
    finally:
        for rope in ropes:
            rope.pass_end = 0


def prefill_head(model: Any, prompt: mx.array, cache: Sequence[Any], **kwargs: Any) -> bool:
    """``prefill`` of all of ``prompt`` but its last id, which the caller feeds next (its
    logits start generation): what every decode loop does first. ``kwargs`` as ``prefill``'s."""
    return prefill(model, prompt[:-1], cache, trailing=1, **kwargs)


def _feed(
    model: Any,
    prompt: mx.array,
    cache: Sequence[Any],
    chunk: int,
    cancel: threading.Event | None,
    on_progress: ProgressCallback | None,
    inputs: PromptInputs | None,
) -> bool:
    total = int(prompt.size)
    done = 0
    while done < total:
        if cancel is not None and cancel.is_set():
            return False
        end = min(done + chunk, total)
        kwargs: dict[str, Any] = {}
        if inputs is not None:
            end = min(inputs.chunk_end(done, end), total)
            kwargs = inputs.kwargs(done, end)
        model(prompt[None, done:end], cache=cache, **kwargs)
        mx.eval(_cache_arrays(cache))
        done = end
        if on_progress is not None:
            on_progress(done, total)
    # The end of a prompt: recurrent layers (which cannot be cut back) keep a copy of their
    # state here, so regenerating the reply can return to it.
    for c in cache:
        getattr(c, "mark_prompt_end", lambda: None)()
    return True
