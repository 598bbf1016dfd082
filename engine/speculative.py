"""Speculative decoding with exact verification: a draft model or n-gram prompt lookup.

A drafter proposes up to k tokens; the target model scores the pending token and all k drafts
in one forward pass; the longest acceptable run of drafts is kept, plus one token from the
target (the correction after a rejection, or a bonus token when every draft was accepted).

* Greedy: a draft is accepted while it equals the target's argmax, so the output is the
  target's own greedy output token for token.
* Sampling: standard rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft d with
  draft probability q(d) is accepted with probability min(1, p(d) / q(d)); after a rejection the
  token is drawn from normalise(max(0, p - q)). An n-gram draft is a point mass (q(d) = 1), so
  it is accepted with probability p(d) and the residual is p with d removed. Either way every
  emitted token is distributed exactly as the target's sampler would draw it.

``p`` is the target's sampling distribution after the request's logits processors (repetition
penalty) and filters (temperature, top-k, top-p, min-p), exactly as ``engine.sampling`` builds
it. Rejected drafts are rewound with the caches' ``trim``. A cache that cannot trim (a sliding
window that has wrapped) turns drafting off for the rest of the request: it continues as plain
decoding, still exact.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .api import GenerationStats, SamplingParams
from .cache import make_prompt_cache, trim_prompt_cache
from .errors import EngineError
from .fast_decode import compiled_decoder
from .generate import ProgressCallback, PromptInputs, prefill
from .sampling import LogitsProcessor, filter_logits

# How far back logits processors (repetition penalty) look; as in the plain decode loop.
_HISTORY_WINDOW = 1024

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

    def __init__(self, model: Any, cache: list | None = None, max_draft: int = 4, prefill_chunk: int = 512,
                 compiled: bool | None = None):
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

    def _can_take(self, n_new: int) -> bool:
        return all(_room_to_trim(c, n_new) for c in self.cache)

    def _step(self, tokens: mx.array) -> mx.array:
        """Lazy logits [V] after the last of ``tokens`` (shape [n], n small)."""
        if self._decoder is False:
            self._decoder = _decoder_for(self.model, self.compiled)
        if self._decoder is not None:
            logits = self._decoder(tokens, self.cache)
            if logits is not None:
                return logits[-1]
        return self.model(tokens[None], cache=self.cache)[0, -1]

    def propose(self, history: list[int], k: int, pick: Pick) -> tuple[mx.array | list[int], mx.array | None]:
        if k <= 0 or not self.usable:
            return [], None
        if self.offset >= len(history):  # cached more than is settled: step back one token
            self.rewind(len(history) - 1)
        if self.offset >= len(history) or not self._can_take(len(history) - self.offset + k):
            self.usable = False  # a wrapped sliding window cannot be rewound
            return [], None
        unseen = self._known(history[self.offset :])
        if len(unseen) > _LAZY_FEED:
            prefill(self.model, mx.array(unseen[:-1], dtype=mx.uint32), self.cache, chunk=self.prefill_chunk)
            unseen = unseen[-1:]
        # Usually the last accepted draft and the target's token: one pass feeds both.
        logits = self._step(mx.array(unseen, dtype=mx.uint32))
        recent = mx.array(self._known(history[-_HISTORY_WINDOW:]), dtype=mx.uint32)
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        for i in range(k):
            token, q = pick(logits, recent)
            mx.async_eval(token)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                recent = mx.concatenate([recent, token])[-_HISTORY_WINDOW:]
                logits = self._step(token)
        return mx.concatenate(tokens), (mx.stack(probs) if probs else None)

    def rewind(self, valid: int) -> None:
        extra = self.offset - valid
        if extra > 0 and trim_prompt_cache(self.cache, extra) != extra:
            self.usable = False


def _embedding_rows(model: Any) -> int | None:
    """How many ids the model's embedding table holds (None: cannot tell)."""
    table = getattr(model, "embed_tokens", None)
    rows = getattr(table, "num_embeddings", None)  # a quantized table
    if rows is None and getattr(table, "weight", None) is not None:
        rows = table.weight.shape[0]
    if rows is None:
        rows = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(rows) if rows is not None else None


def _decoder_for(model: Any, compiled: bool | None) -> Any:
    """The model's compiled one-token step, prepared, or None (plain forward passes)."""
    if compiled is None:
        compiled = mx.default_device() == mx.gpu
    decoder = compiled_decoder(model) if compiled else None
    return decoder if decoder is not None and decoder.prepare() else None


def make_drafter(
    mode: str | None,
    *,
    ngram_size: int = 3,
    num_draft_tokens: int = 4,
    draft_model: Any = None,
    draft_cache: list | None = None,
    prefill_chunk: int = 512,
) -> Drafter | None:
    """The drafter a request asks for (``GenerationParams.speculative``), or None for plain
    decoding. "draft" needs ``draft_model``; ``draft_cache`` may hold a prefix of the request's
    context already (prefix reuse), or be None for a fresh one."""
    if mode is None:
        return None
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


def _room_to_trim(c: Any, n_new: int) -> bool:
    """Can this cache take ``n_new`` more tokens and still give them back?"""
    if not c.is_trimmable():
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


def _fit(q: mx.array, vocab: int) -> mx.array:
    """Draft distributions over the target's vocabulary size (embedding tables are often padded)."""
    have = q.shape[-1]
    if have == vocab:
        return q
    if have > vocab:
        return q[..., :vocab]
    return mx.concatenate([q, mx.zeros((*q.shape[:-1], vocab - have), q.dtype)], axis=-1)


def speculative_step(
    prompt: Sequence[int],
    model: Any,
    cache: Sequence[Any],
    drafter: Drafter,
    *,
    max_tokens: int,
    sampling: SamplingParams | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    logprobs: bool = False,
    num_draft_tokens: int | None = None,
    stats: GenerationStats | None = None,
    prefill_chunk: int = 512,
    cancel: threading.Event | None = None,
    history: Sequence[int] | None = None,
    on_progress: ProgressCallback | None = None,
    compiled: bool | None = None,
    inputs: PromptInputs | None = None,
) -> Iterator[tuple[int, float | None]]:
    """Yield ``(token_id, logprob or None)`` for up to ``max_tokens`` tokens, like
    ``engine.generate.generate_step`` but drafting and verifying several tokens per pass.

    ``prompt`` holds the ids not yet in ``cache`` (at least one); ``history`` is the whole
    context they end (cached part included; default ``prompt``) for n-gram lookup and the
    repetition penalty. The log-prob is the chosen token's under the target's raw
    distribution. ``stats.draft_tokens`` / ``accepted_draft_tokens`` are updated as drafts are
    verified. When the consumer stops early, the caches are left holding exactly the ids before
    the last yielded token, as after plain decoding. ``on_progress(done, total)`` follows the
    prefill, as in ``generate_step``. ``compiled`` as there: one-token target steps (and a
    draft model's steps) use the compiled decoder; None = on a GPU only.

    ``inputs`` carries a prompt's media (embeddings with image or audio features spliced in,
    Gemma 3's bidirectional image blocks), offsets into ``prompt``: the prefill and the first
    pass, which feeds the prompt's last id, use them; every later pass is text. Multimodal
    RoPE (``inputs.positions``) is refused: its decode positions are shifted, and verification
    passes do not model that shift.

    Each round (draft, verify, accept) waits for the device once: drafting, verification and
    acceptance are one lazy graph, and a single array of results comes back to the host.
    """
    ids = [int(t) for t in prompt]
    if not ids:
        raise EngineError("nothing to generate from: the prompt has no tokens")
    if inputs is not None and inputs.positions is not None:
        raise EngineError(
            "speculative decoding cannot follow multimodal RoPE positions (Qwen2.5-VL images): "
            "decode this prompt without a drafter"
        )
    if max_tokens <= 0:
        return
    params = sampling or SamplingParams()
    greedy = params.temperature <= 0
    processors = list(logits_processors)
    k_max = max(0, num_draft_tokens if num_draft_tokens is not None else drafter.max_draft)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    key = [mx.random.key(seed)]
    context = list(history) if history is not None else list(ids)
    if context[-len(ids) :] != ids:
        context = context + ids
    if isinstance(drafter, DraftModelDrafter) and drafter.compiled is None:
        drafter.compiled = compiled
    decoder = _decoder_for(model, compiled)

    def next_key() -> mx.array:
        key[0], sub = mx.random.split(key[0])
        return sub

    def process(logits: mx.array, recent: mx.array) -> mx.array:
        if not processors:
            return logits
        out = logits[None]
        for proc in processors:
            out = proc(recent, out)
        return out[0]

    def distribution(processed: mx.array) -> mx.array:
        return mx.softmax(filter_logits(processed.astype(mx.float32), params), axis=-1)

    def pick(logits: mx.array, recent: mx.array) -> tuple[mx.array, mx.array | None]:
        processed = process(logits, recent)
        if greedy:
            return mx.argmax(processed, axis=-1, keepdims=True).astype(mx.uint32), None
        q = distribution(processed)
        token = mx.random.categorical(mx.log(q), key=next_key())
        return token.reshape(1).astype(mx.uint32), q

    # The prompt's last id is fed by the first pass (a verification or a plain step); its
    # embedding may be part of a media run, so that pass takes embeddings, not ids.
    head_row = [inputs.embeddings[-1:] if inputs is not None and inputs.embeddings is not None else None]

    def forward(fed: mx.array, n: int) -> mx.array:
        """Lazy logits [n, V] for the last ``n`` of the fed ids."""
        if head_row[0] is not None:
            embeddings, head_row[0] = head_row[0], None
            if fed.shape[0] > 1:  # the drafts after it are text
                embeddings = mx.concatenate([embeddings, model.embed(fed[None, 1:])[0]])
            return model(fed[None], cache=cache, input_embeddings=embeddings[None])[0, -n:]
        if decoder is not None and n == fed.shape[0]:
            out = decoder(fed, cache)  # a one-token step, or the drafts' verification
            if out is not None:
                return out
        return model(fed[None], cache=cache)[0, -n:]

    prompt_head = mx.array(ids[:-1], dtype=mx.uint32)
    if not prefill(model, prompt_head, cache, chunk=prefill_chunk, cancel=cancel, on_progress=on_progress,
                   inputs=inputs):
        return
    pending = ids[-1:]  # ids whose keys/values the target has not computed yet
    speculate = k_max > 0
    produced = 0
    carried: tuple[list[int], None] | None = None  # drafts a plain run's lookup found
    while produced < max_tokens:
        if cancel is not None and cancel.is_set():
            return
        k = min(k_max, max_tokens - produced - 1) if speculate else 0
        if k > 0 and not all(_room_to_trim(c, len(pending) + k) for c in cache):
            speculate, k = False, 0  # plain decoding from here on
        if carried is not None and k > 0:
            proposed, q_rows = carried
        else:
            proposed, q_rows = drafter.propose(context, k, pick) if k > 0 else ([], None)
        carried = None
        on_host = isinstance(proposed, list)
        if k > 0 and on_host and not proposed:
            # Nothing to verify: decode plainly, a step ahead, until a lookup finds drafts.
            def lookup(n_left: int) -> tuple[list[int], None] | None:
                k_next = min(k_max, n_left - 1)
                found = drafter.propose(context, k_next, pick) if k_next > 0 else ([], None)
                return found if found[0] else None

            carried, n = yield from _lookahead_run(
                context, forward, pick, logprobs, cache, lookup, max_tokens - produced, cancel,
                processed=bool(processors),
            )
            produced += n
            pending = context[-1:]
            continue
        drafts = mx.array(proposed[:k], dtype=mx.uint32) if on_host else proposed[:k]
        m = int(drafts.shape[0])
        fed = mx.concatenate([mx.array(pending, dtype=mx.uint32), drafts]) if m else mx.array(pending, dtype=mx.uint32)
        logits = forward(fed, m + 1)
        if processors:  # each position sees the context up to its own draft
            recent = mx.array(context[-_HISTORY_WINDOW:], dtype=mx.uint32)
            rows = [process(logits[0], recent)]
            rows += [process(logits[i], mx.concatenate([recent, drafts[:i]])[-_HISTORY_WINDOW:]) for i in range(1, m + 1)]
            logits_p = mx.stack(rows)
        else:
            logits_p = logits
        accepted_a, last_a = _verify(logits_p, drafts, q_rows, greedy, distribution, next_key)
        # One read per round: [accepted, last, drafts..., log-probs...] as float32 (token ids
        # below 2**24 are exact there).
        parts = [accepted_a.reshape(1), last_a.reshape(1)]
        if not on_host:
            parts.append(drafts)
        if logprobs:
            parts.append(_logprobs(logits, drafts, accepted_a, last_a))
        values = mx.concatenate([a.astype(mx.float32) for a in parts]).tolist()
        accepted, last = int(values[0]), int(values[1])
        draft_ids = list(proposed[:k]) if on_host else [int(v) for v in values[2 : 2 + m]]
        emitted = draft_ids[:accepted] + [last]
        trim_prompt_cache(cache, m - accepted)  # drop the rejected drafts' keys/values
        if stats is not None:
            stats.draft_tokens += m
            stats.accepted_draft_tokens += accepted
        lp_start = 2 + (0 if on_host else m)
        lps: list[float | None] = list(values[lp_start : lp_start + len(emitted)]) if logprobs else [None] * len(emitted)
        base = len(context)
        context.extend(emitted)
        pending = [last]
        drafter.rewind(len(context) - 1)
        for j, (token, lp) in enumerate(zip(emitted, lps)):
            try:
                yield token, lp
            except GeneratorExit:
                # Keep "cache = every id before the last yielded one" when stopped mid-run.
                unused = len(emitted) - 1 - j
                trim_prompt_cache(cache, unused)
                drafter.rewind(base + j)
                raise
            produced += 1
            if produced >= max_tokens:
                return


def _lookahead_run(
    context: list[int],
    forward: Callable[[mx.array, int], mx.array],
    pick: Pick,
    logprobs: bool,
    cache: Sequence[Any],
    lookup: Callable[[int], tuple[list[int], None] | None],
    budget: int,
    cancel: threading.Event | None,
    *,
    processed: bool,
) -> Generator[tuple[int, float | None], None, tuple[tuple[list[int], None] | None, int]]:
    """Plain decoding for as long as a host drafter (n-gram lookup) finds nothing to draft.

    As in the plain loop, step n+1 is queued before token n is read, so a lookup that keeps
    missing costs no extra wait on the device. After each token the lookup runs again; when
    it finds drafts, the queued step is trimmed off (the verification round feeds that token
    with its drafts) and the drafts are returned for it, with how many tokens were yielded.
    Leaves the caches holding every id before the last yielded one (``context[-1]``), as a
    verification round would. Tokens are appended to ``context``."""
    n = 0

    def step(token: mx.array, unread: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
        """Lazy (next token, its log-prob) after ``token``; ``unread`` is ``token`` when it is
        not in ``context`` yet, for the logits processors' view of the history."""
        logits = forward(token, 1)[0]
        recent = None
        if processed:
            recent = mx.array(context[-_HISTORY_WINDOW:], dtype=mx.uint32)
            if unread is not None:
                recent = mx.concatenate([recent, unread])[-_HISTORY_WINDOW:]
        y, _ = pick(logits, recent)
        lp = None
        if logprobs:
            raw = logits.astype(mx.float32)
            lp = (raw - mx.logsumexp(raw, axis=-1, keepdims=True))[y[0]]
        mx.async_eval([a for a in (y, lp) if a is not None])
        return y, lp

    y, lp = step(mx.array(context[-1:], dtype=mx.uint32))
    while True:
        ahead = n + 1 < budget and all(_room_to_trim(c, 1) for c in cache)
        queued = step(y, unread=y) if ahead else None  # feeds y to the caches
        token = int(y.item())
        context.append(token)
        try:
            yield token, (float(lp.item()) if lp is not None else None)
        except GeneratorExit:
            if queued is not None:
                trim_prompt_cache(cache, 1)
            raise
        n += 1
        stop = queued is None or (cancel is not None and cancel.is_set())
        found = None if stop else lookup(budget - n)
        if stop or found is not None:
            if queued is not None:
                trim_prompt_cache(cache, 1)
            return found, n
        y, lp = queued


def speculative_decode(
    model: Any, cache: Sequence[Any], drafter: Drafter, prompt: Sequence[int], **options: Any
) -> Iterator[tuple[int, float | None]]:
    """``speculative_step`` with the model first; ``options`` as there (``max_tokens`` required)."""
    return speculative_step(prompt, model, cache, drafter, **options)


def _first_rejection(ok: mx.array) -> mx.array:
    """How many leading entries of the boolean vector are true (on the device)."""
    return mx.cumprod(ok.astype(mx.int32)).sum()


def _verify(
    rows: mx.array,
    drafts: mx.array,
    q_rows: mx.array | None,
    greedy: bool,
    distribution: Callable[[mx.array], mx.array],
    next_key: Callable[[], mx.array],
) -> tuple[mx.array, mx.array]:
    """Lazy (how many drafts are accepted, the token the target adds after them)."""
    m = int(drafts.shape[0])
    if greedy:
        best = mx.argmax(rows, axis=-1)
        if not m:
            return mx.array(0, dtype=mx.int32), best[0]
        accepted = _first_rejection(best[:m] == drafts)
        return accepted, mx.take(best, accepted)
    p = distribution(rows)  # [m + 1, V]
    vocab = p.shape[-1]
    if not m:
        return mx.array(0, dtype=mx.int32), mx.random.categorical(mx.log(p[0]), key=next_key())
    d = drafts.astype(mx.int32)
    safe_d = mx.minimum(d, vocab - 1)
    p_d = mx.where(d < vocab, mx.take_along_axis(p[:m], safe_d[:, None], axis=-1)[:, 0], 0.0)
    q = _fit(q_rows, vocab) if q_rows is not None else None
    q_d = mx.take_along_axis(q, safe_d[:, None], axis=-1)[:, 0] if q is not None else mx.ones((m,))
    u = mx.random.uniform(shape=(m,), key=next_key())
    accepted = _first_rejection(u * q_d < p_d)  # u < p/q without dividing by zero
    # The row after the accepted run; when every draft is accepted it is p[m] itself.
    j = mx.minimum(accepted, m - 1)
    p_j = mx.take(p, j, axis=0)
    if q is not None:
        residual = mx.maximum(p_j - mx.take(q, j, axis=0), 0.0)
    else:
        residual = p_j * (mx.arange(vocab) != mx.take(d, j))
    total = residual.sum()
    # p == q (to rounding) cannot reject; if it did anyway, fall back to p itself.
    after_rejection = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_j)
    target = mx.where(accepted == m, p[m], after_rejection)
    return accepted, mx.random.categorical(mx.log(target), key=next_key())


def _logprobs(logits: mx.array, drafts: mx.array, accepted: mx.array, last: mx.array) -> mx.array:
    """Lazy log-probs [m + 1] of the emitted tokens (drafts up to ``accepted``, then ``last``)
    under the raw logits; entries past ``accepted`` are unused."""
    raw = logits.astype(mx.float32)
    lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    m = int(drafts.shape[0])
    padded = mx.concatenate([drafts.astype(mx.int32), mx.zeros((1,), mx.int32)])
    chosen = mx.where(mx.arange(m + 1) < accepted, padded, last.astype(mx.int32))
    return mx.take_along_axis(lp, chosen[:, None], axis=-1)[:, 0]
