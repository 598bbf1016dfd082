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
penalty) and filters (temperature, top-k, top-p, min-p), exactly as ``engine.decode.sampling`` builds
it. Rejected drafts are rewound with the caches' ``trim``. A cache that cannot trim (a sliding
window that has wrapped) turns drafting off for the rest of the request: it continues as plain
decoding, still exact. The drafters themselves are in ``engine.decode.drafters``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import mlx.core as mx

from engine.api import SamplingParams
from engine.decode.draft_depth import DraftDepth, FixedDepth
from engine.decode.drafters import Drafter, DraftModelDrafter, Pick, decoder_for, room_to_trim
from engine.decode.guards import check_finite
from engine.decode.prefill import HISTORY_WINDOW, ProgressCallback, PromptInputs, prefill_head
from engine.decode.sampling import LogitsProcessor, filter_logits
from engine.decode.stats import StatsCounter
from engine.errors import EngineError
from engine.models.kv_cache import trim_prompt_cache

DepthPolicy = DraftDepth | FixedDepth
# A prefill of at least this many ids says what the next ones cost (fewer: mostly overhead).
_RATE_IDS = 32


def _fit(q: mx.array, vocab: int) -> mx.array:
    """Draft distributions over the target's vocabulary size (embedding tables are often padded)."""
    have = q.shape[-1]
    if have == vocab:
        return q
    if have > vocab:
        return q[..., :vocab]
    return mx.concatenate([q, mx.zeros((*q.shape[:-1], vocab - have), q.dtype)], axis=-1)


class _Target:
    """The target model's side of a round: its forward passes (a media prompt's last row
    first, then the compiled step where it applies, multimodal RoPE's shifted positions),
    the request's logits processors and its sampling distribution and draws."""

    def __init__(
        self,
        model: Any,
        cache: Sequence[Any],
        params: SamplingParams,
        processors: list[LogitsProcessor],
        inputs: PromptInputs | None,
        compiled: bool | None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.params = params
        self.greedy = params.temperature <= 0
        self.processors = processors
        self.decoder = decoder_for(model, compiled)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)
        # The prompt's last id is fed by the first pass (a verification or a plain step); its
        # embedding may be part of a media run, so that pass takes embeddings, not ids.
        self._head_row = inputs.embeddings[-1:] if inputs is not None and inputs.embeddings is not None else None
        self._shift = inputs.position_delta if inputs is not None and inputs.positions is not None else None

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def process(self, logits: mx.array, recent: mx.array) -> mx.array:
        if not self.processors:
            return logits
        out = logits[None]
        for proc in self.processors:
            out = proc(recent, out)
        return out[0]

    def distribution(self, processed: mx.array) -> mx.array:
        return mx.softmax(filter_logits(processed.astype(mx.float32), self.params), axis=-1)

    def pick(self, logits: mx.array, recent: mx.array) -> tuple[mx.array, mx.array | None]:
        processed = self.process(logits, recent)
        if self.greedy:
            return mx.argmax(processed, axis=-1, keepdims=True).astype(mx.uint32), None
        q = self.distribution(processed)
        token = mx.random.categorical(mx.log(q), key=self.next_key())
        return token.reshape(1).astype(mx.uint32), q

    def positions(self, n: int) -> dict[str, mx.array]:
        """Multimodal RoPE's position ids for ``n`` text tokens fed at the cache offset."""
        if self._shift is None:
            return {}
        start = int(self.cache[0].offset) + self._shift
        return {"position_ids": mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32)[None, None], (3, 1, n))}

    def forward(self, fed: mx.array, n: int) -> mx.array:
        """Lazy logits [n, V] for the last ``n`` of the fed ids."""
        model, cache = self.model, self.cache
        if self._head_row is not None:
            embeddings, self._head_row = self._head_row, None
            if fed.shape[0] > 1:  # the drafts after it are text (zeros where media rows are wider)
                drafts = model.embed(fed[None, 1:])[0]
                drafts = mx.pad(drafts, [(0, 0), (0, embeddings.shape[-1] - drafts.shape[-1])])
                embeddings = mx.concatenate([embeddings, drafts])
            return model(fed[None], cache=cache, input_embeddings=embeddings[None], **self.positions(fed.shape[0]))[
                0, -n:
            ]
        if self.decoder is not None and n == fed.shape[0]:
            out = self.decoder(fed, cache, self._shift or 0)  # a one-token step, or the drafts' verification
            if out is not None:
                return out
        return model(fed[None], cache=cache, **self.positions(fed.shape[0]))[0, -n:]


class _Drafting:
    """The drafter's side of a request: asks it for drafts (a draft model first catching up
    on the ids it has not seen, timed apart as the cost of having stopped drafting), and
    times each round from the ask, noting whether a compiled decoder traced a new pass size
    meanwhile (a round that traces one is slow once only)."""

    def __init__(self, drafter: Drafter, depth: DepthPolicy, target: _Target, context: list[int]) -> None:
        self.drafter = drafter
        self.depth = depth
        self.target = target
        self.context = context
        self._catch_up = getattr(drafter, "catch_up", None)
        self._drafter_decoder = getattr(drafter, "decoder", lambda: None)
        self.asked_at = 0.0
        self._traces_then = 0

    def traces(self) -> int:
        both = {
            id(d): d for d in (self.target.decoder, self._drafter_decoder()) if d is not None
        }  # one, drafting for itself
        return sum(getattr(d, "traces", 0) for d in both.values())

    def watch_catch_up(self, fed: int, prefill_s: float) -> None:
        """A draft model must be fed the ids it has not seen (the prompt first) before it
        drafts: the depth guesses each at what the target's prefill just cost one (``fed``
        ids in ``prefill_s``), scaled to the draft."""
        if self._catch_up is None or not hasattr(self.depth, "watch_catch_up"):
            return
        drafter = self.drafter
        guess = prefill_s / fed * drafter.relative_cost(self.target.model) if fed >= _RATE_IDS else None
        self.depth.watch_catch_up(lambda: drafter.behind(self.context), guess)

    def ask(self, k: int) -> tuple[Any, Any]:
        """The drafter's proposal of up to ``k`` drafts."""
        if self._catch_up is not None:
            behind = self.drafter.behind(self.context)
            t = time.perf_counter()
            if self._catch_up(self.context):
                self.depth.overhead(time.perf_counter() - t, behind)
        self.asked_at, self._traces_then = time.perf_counter(), self.traces()
        return self.drafter.propose(self.context, k, self.target.pick)

    def found(self, k: int) -> tuple[Any, Any] | None:
        """``ask``, or None when the drafter found nothing (host ids, or a device array: MTP)."""
        proposal = self.ask(k)
        return proposal if len(proposal[0]) else None

    def timed_round(self, drafted: int, accepted: int) -> None:
        self.depth.round(
            drafted, accepted, time.perf_counter() - self.asked_at, fresh=self.traces() != self._traces_then
        )


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
    stats: StatsCounter | None = None,
    prefill_chunk: int = 512,
    cancel: threading.Event | None = None,
    history: Sequence[int] | None = None,
    on_progress: ProgressCallback | None = None,
    compiled: bool | None = None,
    inputs: PromptInputs | None = None,
    depth: DepthPolicy | None = None,
) -> Iterator[tuple[int, float | None]]:
    """Yield ``(token_id, logprob or None)`` for up to ``max_tokens`` tokens, like
    ``engine.decode.loop.generate_step`` but drafting and verifying several tokens per pass.

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
    pass, which feeds the prompt's last id, use them; every later pass is text. After
    multimodal RoPE (``inputs.positions``) every pass after the prefill is text at the cache
    offset shifted by the prompt's delta (the prompt ends in text, whose three position ids
    are equal): verification passes take those positions, the compiled step the shift.

    Each round (draft, verify, accept) waits for the device once: drafting, verification and
    acceptance are one lazy graph, and a single array of results comes back to the host.

    ``depth`` chooses each round's drafts (``engine.decode.draft_depth``: ``DraftDepth``
    adapts them to measured costs and acceptance, and answers 0 when plain steps are faster);
    by default every round drafts ``num_draft_tokens`` (else the drafter's ``max_draft``).
    Plain tokens, whether the depth or a lookup that found nothing asked for them, are
    decoded pipelined as in the plain loop, each checked for NaN as there.
    """
    ids = [int(t) for t in prompt]
    if not ids:
        raise EngineError("nothing to generate from: the prompt has no tokens")
    if max_tokens <= 0:
        return
    processors = list(logits_processors)
    if depth is None:
        depth = FixedDepth(num_draft_tokens if num_draft_tokens is not None else drafter.max_draft)
    context = list(history) if history is not None else list(ids)
    if context[-len(ids) :] != ids:
        context = context + ids
    if isinstance(drafter, DraftModelDrafter) and drafter.compiled is None:
        drafter.compiled = compiled
    target = _Target(model, cache, sampling or SamplingParams(), processors, inputs, compiled)

    began = time.perf_counter()
    whole = mx.array(ids, dtype=mx.uint32)
    if not prefill_head(
        model, whole, cache, chunk=prefill_chunk, cancel=cancel, on_progress=on_progress, inputs=inputs
    ):
        return
    drafting = _Drafting(drafter, depth, target, context)
    drafting.watch_catch_up(len(ids) - 1, time.perf_counter() - began)
    pending = ids[-1:]  # ids whose keys/values the target has not computed yet
    speculate = depth.k_max > 0
    produced = 0
    carried: tuple[Any, Any] | None = None  # drafts a plain run's lookup found

    while produced < max_tokens:
        if cancel is not None and cancel.is_set():
            return
        if carried is not None:
            proposed, q_rows = carried
            k = int(len(proposed))
            if not all(room_to_trim(c, len(pending) + k) for c in cache):
                speculate, k, proposed, q_rows = False, 0, [], None
        else:
            k = depth.next(max_tokens - produced - 1) if speculate else 0
            if k > 0 and not all(room_to_trim(c, len(pending) + k) for c in cache):
                speculate, k = False, 0  # plain decoding from here on
            proposed, q_rows = drafting.ask(k) if k > 0 else ([], None)
        carried = None
        if speculate and isinstance(proposed, list) and not proposed:
            # Nothing to verify (the depth chose a plain token, or a lookup found nothing):
            # decode plainly, a step ahead, until the depth asks for drafts and they are found.
            carried, n = yield from _lookahead_run(
                context,
                target.forward,
                target.pick,
                logprobs,
                cache,
                depth.next,
                drafting.found,
                max_tokens - produced,
                cancel,
                processed=bool(processors),
                timed=depth.plain,
                may_miss=getattr(drafter, "may_miss", False),
            )
            produced += n
            pending = context[-1:]
            continue
        emitted, lps = _verify_round(target, drafting, proposed, q_rows, k, pending, logprobs, stats)
        base = len(context)
        context.extend(emitted)
        pending = emitted[-1:]
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


def _verify_round(
    target: _Target,
    drafting: _Drafting,
    proposed: Any,
    q_rows: Any,
    k: int,
    pending: list[int],
    logprobs: bool,
    stats: StatsCounter | None,
) -> tuple[list[int], list[float | None]]:
    """One round: the target scores ``pending`` and the first ``k`` drafts in one pass, the
    acceptable run is kept plus the target's own next token, and the rejected drafts' keys
    and values are trimmed off. Returns the emitted ids and their log-probs (None each
    without ``logprobs``). The round waits for the device once: drafting, verification and
    acceptance are one lazy graph, and a single array of results comes back."""
    context = drafting.context
    on_host = isinstance(proposed, list)
    drafts = mx.array(proposed[:k], dtype=mx.uint32) if on_host else proposed[:k]
    m = int(drafts.shape[0])
    fed = mx.concatenate([mx.array(pending, dtype=mx.uint32), drafts]) if m else mx.array(pending, dtype=mx.uint32)
    logits = target.forward(fed, m + 1)
    if target.processors:  # each position sees the context up to its own draft
        recent = mx.array(context[-HISTORY_WINDOW:], dtype=mx.uint32)
        rows = [target.process(logits[0], recent)]
        rows += [
            target.process(logits[i], mx.concatenate([recent, drafts[:i]])[-HISTORY_WINDOW:]) for i in range(1, m + 1)
        ]
        logits_p = mx.stack(rows)
    else:
        logits_p = logits
    accepted_a, last_a = _verify(logits_p, drafts, q_rows, target.greedy, target.distribution, target.next_key)
    # One read per round: [accepted, last, drafts..., log-probs...] as float32 (token ids
    # below 2**24 are exact there).
    parts = [accepted_a.reshape(1), last_a.reshape(1)]
    if not on_host:
        parts.append(drafts)
    if logprobs:
        parts.append(_logprobs(logits, drafts, accepted_a, last_a))
    parts.append(mx.max(logits[:1]).reshape(1))  # last: NaN or inf means damaged weights
    values = mx.concatenate([a.astype(mx.float32) for a in parts]).tolist()
    check_finite(values[-1])
    accepted, last = int(values[0]), int(values[1])
    if m:
        drafting.timed_round(m, accepted)
    draft_ids = list(proposed[:k]) if on_host else [int(v) for v in values[2 : 2 + m]]
    emitted = draft_ids[:accepted] + [last]
    trim_prompt_cache(target.cache, m - accepted)  # drop the rejected drafts' keys/values
    if stats is not None:
        stats.draft_tokens += m
        stats.accepted_draft_tokens += accepted
    lp_start = 2 + (0 if on_host else m)
    lps: list[float | None] = list(values[lp_start : lp_start + len(emitted)]) if logprobs else [None] * len(emitted)
    return emitted, lps


def _lookahead_run(
    context: list[int],
    forward: Callable[[mx.array, int], mx.array],
    pick: Pick,
    logprobs: bool,
    cache: Sequence[Any],
    decide: Callable[[int], int],
    fetch: Callable[[int], tuple[Any, Any] | None],
    budget: int,
    cancel: threading.Event | None,
    *,
    processed: bool,
    timed: Callable[[float], None] | None = None,
    may_miss: bool = False,
) -> Generator[tuple[int, float | None], None, tuple[tuple[Any, Any] | None, int]]:
    """Plain decoding until the depth asks for drafts (``decide(room)`` > 0, asked once per
    token) and the drafter finds some (``fetch(k)``); returns them, with how many tokens were
    yielded.

    As in the plain loop, step n+1 is queued before token n is read, so the device never
    waits for Python. The depth is asked before the step is queued: when it wants drafts
    next and the drafter always has some (a model), nothing is queued that the round would
    drop. A drafter that ``may_miss`` (n-gram lookup) keeps the step queued, so a lookup that
    finds nothing costs no wait; when it finds drafts, the queued step is trimmed off (the
    verification round feeds that token with its drafts). Leaves the caches holding every id
    before the last yielded one (``context[-1]``), as a verification round would. Tokens are
    appended to ``context``. Each token's raw logit (or log-prob) is checked for NaN, as in
    the plain loop; ``timed(seconds)`` gets each token's time, the consumer's share left out."""
    n = 0

    def step(token: mx.array, unread: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Lazy (next token [1], [that token, its log-prob] as float32) after ``token``; without
        log-probs the raw logit stands in for the log-prob (either is NaN when the logits are).
        ``unread`` is ``token`` when it is not in ``context`` yet, for the logits processors'
        view of the history."""
        logits = forward(token, 1)[0]
        recent = None
        if processed:
            recent = mx.array(context[-HISTORY_WINDOW:], dtype=mx.uint32)
            if unread is not None:
                recent = mx.concatenate([recent, unread])[-HISTORY_WINDOW:]
        y, _ = pick(logits, recent)
        raw = logits.astype(mx.float32)
        lp = (raw - mx.logsumexp(raw, axis=-1, keepdims=True))[y[0]] if logprobs else raw[y[0]]
        read = mx.concatenate([y.astype(mx.float32), lp.reshape(1)])  # one read per token
        mx.async_eval([y, read])
        return y, read

    clock = time.perf_counter
    began = clock()
    y, lp = step(mx.array(context[-1:], dtype=mx.uint32))
    while True:
        more = n + 1 < budget and all(room_to_trim(c, 1) for c in cache)
        k_next = decide(budget - n - 2) if more else 0  # drafts for the token after this one
        queued = step(y, unread=y) if more and (k_next <= 0 or may_miss) else None  # feeds y
        token_f, value = lp.tolist()
        token = int(token_f)
        check_finite(value)  # NaN logits: damaged weights, as the plain loop says
        context.append(token)
        if timed is not None:
            timed(clock() - began)
        try:
            yield token, (value if logprobs else None)
        except GeneratorExit:
            if queued is not None:
                trim_prompt_cache(cache, 1)
            raise
        n += 1
        began = clock()
        found = None
        if more and not (cancel is not None and cancel.is_set()) and k_next > 0:
            found = fetch(k_next)
            if found is None and queued is None:  # no drafts after all: this token's step, now
                queued = step(y, unread=y)
        if found is not None or queued is None or (cancel is not None and cancel.is_set()):
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
