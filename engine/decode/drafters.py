"""Drafters for speculative decoding: n-gram prompt lookup and a small draft model.

A drafter proposes up to k tokens to follow the history; ``engine.decode.speculative`` verifies
them against the target. ``make_drafter`` builds the one a request asks for, and
``check_draft_compatible`` refuses a draft model that numbers tokens differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.decode.compiled_hybrid import compiled_decoder  # attention-only or hybrid stacks
from engine.decode.draft_depth import AUTO_MAX_DRAFT
from engine.decode.prefill import HISTORY_WINDOW, prefill, prefill_head
from engine.errors import EngineError
from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache

# pick(logits [V], recent context ids [n]) -> (token [1] uint32, probabilities [V] or None when
# greedy). Lazy: nothing is evaluated, so a drafter can queue all its steps before one sync.
Pick = Callable[[mx.array, mx.array], tuple[mx.array, mx.array | None]]


class Drafter(Protocol):
    max_draft: int

    def propose(self, history: list[int], k: int, pick: Pick) -> tuple[list[int] | mx.array, mx.array | None]:
        """Up to ``k`` tokens to follow ``history`` (host ids, or a lazy uint32 array of exactly
        ``k``), and the distribution each was drawn from ([m, V], or None for point masses)."""

    def rewind(self, valid: int) -> None:
        """Only the first ``valid`` ids of the history are settled; forget anything after."""


@dataclass
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` ids in the prompt and
    the text so far, and propose what followed it. Needs no model; shines when the answer
    repeats its input (code edits, quoting, summaries with names)."""

    n: int = 3
    max_draft: int = 4
    # A lookup often finds nothing: the speculative loop keeps a plain step queued meanwhile.
    may_miss = True

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_draft < 1:
            raise EngineError(f"n-gram drafting needs n >= 1 and max_draft >= 1 (got {self.n}, {self.max_draft})")

    def propose(self, history: list[int], k: int, pick: Pick | None) -> tuple[list[int], mx.array | None]:
        n = self.n
        if k <= 0 or len(history) <= n:
            return [], None
        tail = history[-n:]
        first = tail[0]
        # Scan backwards so the most recent match wins; it predicts the current phrasing best.
        for start in range(len(history) - n - 1, -1, -1):
            if history[start] == first and history[start : start + n] == tail:
                follow = history[start + n : start + n + k]
                return list(follow), None
        return [], None

    def rewind(self, valid: int) -> None:
        pass


# Ids the draft model has not seen beyond this many are fed by chunked prefill (evaluated);
# fewer (the usual one or two per round) join the lazy drafting graph.
_LAZY_FEED = 8


class DraftModelDrafter:
    """A small model of the same vocabulary drafting for the target. Its cache always holds a
    prefix of the history; whatever it has not seen yet is fed before drafting.

    Drafting never waits for the device: the k steps are built lazily (each queued with
    ``async_eval`` so the device starts while Python builds the next), and the target's
    verification reads them back in its one sync. One-token steps go through the model's
    ``CompiledDecoder`` where it applies (``compiled``: None = on a GPU only).

    The draft model reads token ids only. For a prompt with images or audio it reads the
    placeholder ids where the target reads media features, as mlx-lm's drafters do: it cannot
    see the media, but its cache stays aligned one to one with the history (prefix reuse by
    ids, rewinds by count), and what follows the media is ordinary text it can predict. An id
    past its embedding table (a multimodal target's media token, or a special token only the
    target has; Gemma 3's image token is one past Gemma 3 1B's table) is fed as id 0: it
    means nothing to the draft either way, and looking it up would read outside the table."""

    def __init__(
        self,
        model: Any,
        cache: list | None = None,
        max_draft: int = 4,
        prefill_chunk: int = 512,
        compiled: bool | None = None,
    ):
        self.model = model
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.max_draft = max_draft
        self.prefill_chunk = prefill_chunk
        self.usable = True
        self.compiled = compiled
        self._decoder: Any = False  # False: not looked up yet
        self.rows = _embedding_rows(model)

    def _known(self, ids: list[int]) -> list[int]:
        """``ids`` with those past the draft's embedding table replaced by 0."""
        rows = self.rows
        return ids if rows is None else [t if t < rows else 0 for t in ids]

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.cache else 0

    def _can_take(self, n_new: int, back: int) -> bool:
        return all(room_to_trim(c, n_new, back) for c in self.cache)

    def _step(self, tokens: mx.array) -> mx.array:
        """Lazy logits [V] after the last of ``tokens`` (shape [n], n small)."""
        decoder = self.decoder()
        if decoder is not None:
            logits = decoder(tokens, self.cache)
            if logits is not None:
                return logits[-1]
        return self.model(tokens[None], cache=self.cache)[0, -1]

    def decoder(self) -> Any:
        """The compiled step the draft model runs through, or None (plain forward passes)."""
        if self._decoder is False:
            self._decoder = decoder_for(self.model, self.compiled)
        return self._decoder

    def behind(self, history: list[int]) -> int:
        """How many ids of ``history`` the draft model has not been fed."""
        return max(0, len(history) - self.offset) if self.usable else 0

    def relative_cost(self, target: Any) -> float:
        """What feeding an id costs the draft model, as a share of what it costs ``target``:
        their weights' sizes (a prefill reads every weight once per chunk, and computes in
        proportion); 1 for the target drafting for itself."""
        if self.model is target:
            return 1.0
        return weight_bytes(self.model) / max(1, weight_bytes(target))

    def catch_up(self, history: list[int]) -> bool:
        """Feed what the cache has not seen of ``history`` but its last id, by chunked prefill
        (evaluated), when that is more than a round's usual one or two ids: after a new prompt
        or a run of plain tokens. ``propose`` would do it anyway; done apart, the speculative
        loop can time it apart from the round. Returns whether anything was fed."""
        behind = len(history) - self.offset
        if not self.usable or behind <= _LAZY_FEED or not self._can_take(behind + self.max_draft, self.max_draft):
            return False
        unseen = self._known(history[self.offset : -1])
        prefill(self.model, mx.array(unseen, dtype=mx.uint32), self.cache, chunk=self.prefill_chunk)
        return True

    def propose(self, history: list[int], k: int, pick: Pick) -> tuple[mx.array | list[int], mx.array | None]:
        if k <= 0 or not self.usable:
            return [], None
        if self.offset >= len(history):  # cached more than is settled: step back one token
            self.rewind(len(history) - 1)
        if self.offset >= len(history) or not self._can_take(len(history) - self.offset + k, k):
            self.usable = False  # a wrapped sliding window cannot be rewound
            return [], None
        unseen = self._known(history[self.offset :])
        if len(unseen) > _LAZY_FEED:
            prefill_head(self.model, mx.array(unseen, dtype=mx.uint32), self.cache, chunk=self.prefill_chunk)
            unseen = unseen[-1:]
        # Usually the last accepted draft and the target's token: one pass feeds both.
        logits = self._step(mx.array(unseen, dtype=mx.uint32))
        recent = mx.array(self._known(history[-HISTORY_WINDOW:]), dtype=mx.uint32)
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        for i in range(k):
            token, q = pick(logits, recent)
            mx.async_eval(token)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                recent = mx.concatenate([recent, token])[-HISTORY_WINDOW:]
                logits = self._step(token)
        return mx.concatenate(tokens), (mx.stack(probs) if probs else None)

    def rewind(self, valid: int) -> None:
        extra = self.offset - valid
        if extra > 0 and trim_prompt_cache(self.cache, extra) != extra:
            self.usable = False


def weight_bytes(model: Any) -> int:
    """The model's weights' size, counted once per model object (flattening an 8B model's
    parameters takes milliseconds; a guess of relative cost needs no update for adapters)."""
    size = getattr(model, "_weight_bytes", None)
    if size is None:
        size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        try:
            object.__setattr__(model, "_weight_bytes", size)
        except AttributeError:
            pass
    return size


def _embedding_rows(model: Any) -> int | None:
    """How many ids the model's embedding table holds (None: cannot tell)."""
    table = getattr(model, "embed_tokens", None)
    rows = getattr(table, "num_embeddings", None)  # a quantized table
    if rows is None and getattr(table, "weight", None) is not None:
        rows = table.weight.shape[0]
    if rows is None:
        rows = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(rows) if rows is not None else None


def decoder_for(model: Any, compiled: bool | None) -> Any:
    """The model's compiled one-token step, prepared, or None (plain forward passes)."""
    if compiled is None:
        compiled = mx.default_device() == mx.gpu
    decoder = compiled_decoder(model) if compiled else None
    if decoder is None or not decoder.prepare():
        return None
    if getattr(model, "hidden_listener", None) is not None and not getattr(decoder, "feeds_listener", False):
        return None  # an MTP drafter follows the model's passes, which this step would not show it
    return decoder


def make_drafter(
    mode: str | None,
    *,
    ngram_size: int = 3,
    num_draft_tokens: int | None = None,
    draft_model: Any = None,
    draft_cache: list | None = None,
    prefill_chunk: int = 512,
) -> Drafter | None:
    """The drafter a request asks for (``GenerationParams.speculative``), or None for plain
    decoding. "draft" needs ``draft_model``; ``draft_cache`` may hold a prefix of the request's
    context already (prefix reuse), or be None for a fresh one."""
    if mode is None:
        return None
    if num_draft_tokens is None:  # auto: the depth is chosen each round, up to this
        num_draft_tokens = AUTO_MAX_DRAFT
    if num_draft_tokens < 1:
        raise EngineError(f"the number of draft tokens must be at least 1 (got {num_draft_tokens})")
    if mode == "ngram":
        return NgramDrafter(ngram_size, num_draft_tokens)
    if mode == "draft":
        if draft_model is None:
            raise EngineError(
                "speculative decoding with a draft model needs one loaded: load a draft model first, "
                "or use n-gram drafting"
            )
        return DraftModelDrafter(draft_model, draft_cache, num_draft_tokens, prefill_chunk)
    raise EngineError(f"unknown speculative mode {mode!r}; use 'draft', 'ngram' or none")


def drafter_for(params: Any, *, draft_model: Any = None, draft_cache: list | None = None) -> Drafter | None:
    """The drafter a request's ``GenerationParams`` ask for (see ``make_drafter``)."""
    return make_drafter(
        params.speculative,
        ngram_size=params.ngram_size,
        num_draft_tokens=params.num_draft_tokens,
        draft_model=draft_model,
        draft_cache=draft_cache,
        prefill_chunk=params.prefill_chunk,
    )


def room_to_trim(c: Any, n_new: int, back: int | None = None) -> bool:
    """Can this cache take ``n_new`` more tokens and still give them back (the last ``back``
    of them, when fewer may need to go)?"""
    if not c.is_trimmable():
        return False
    recent = getattr(c, "step_window", None)  # a recurrent layer keeps this many recent states
    if recent is not None and (n_new if back is None else back) > recent:
        return False
    max_size = getattr(c, "max_size", None)
    return max_size is None or c.offset + n_new < max_size


def _vocab_of(x: Any) -> dict[str, int]:
    if isinstance(x, dict):
        return x
    backend = getattr(x, "backend", None)  # engine.text's Tokenizer wraps a tokenizers.Tokenizer
    if backend is not None and callable(getattr(backend, "get_vocab", None)):
        return backend.get_vocab()
    for attr in ("get_vocab", "vocab"):
        found = getattr(x, attr, None)
        if callable(found):
            return found()
        if isinstance(found, dict):
            return found
    raise EngineError(f"cannot read a vocabulary from {type(x).__name__}")


def check_draft_compatible(target: Any, draft: Any) -> None:
    """Refuse a draft model whose tokenizer numbers tokens differently from the target's.

    ``target`` and ``draft`` are tokenizers (anything with ``get_vocab()``) or token -> id
    dicts. Tokens that only one side has are fine when their ids lie past the other's
    vocabulary (added special tokens); any id given two meanings is not.
    """
    t_vocab, d_vocab = _vocab_of(target), _vocab_of(draft)
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    d_by_id = {i: tok for tok, i in d_vocab.items()}
    clashes = [i for i in sorted(t_by_id.keys() & d_by_id.keys()) if t_by_id[i] != d_by_id[i]]
    moved = [tok for tok in t_vocab.keys() & d_vocab.keys() if t_vocab[tok] != d_vocab[tok]]
    if clashes or moved:
        if clashes:
            i = clashes[0]
            example = f"id {i} is {t_by_id[i]!r} for the target but {d_by_id[i]!r} for the draft"
        else:
            tok = sorted(moved)[0]
            example = f"{tok!r} is {t_vocab[tok]} for the target but {d_vocab[tok]} for the draft"
        count = max(len(clashes), len(moved))
        raise EngineError(
            f"the draft model's vocabulary does not match the target's ({example}; {count} ids differ): "
            "pick a draft model from the same family and tokenizer, or use n-gram drafting"
        )
