"""The decode loop: pipelined decoding, stop conditions, stats.

``generate_step`` is the bare token loop. It keeps the device busy by queueing step
n+1 (``mx.async_eval``) before it waits for token n, builds only the ops a request needs
(no log-softmax unless log-probs are asked for or the sampler needs them), and never
synchronises except to read the one token it yields.

``token_source`` is the one place that picks where a request's tokens come from: a
``Batch`` row (engine.decode.batch), speculative decoding (engine.decode.speculative), the
rolling window (engine.decode.rolling) or ``generate_step``.

``stream_generate`` only turns those tokens into text: streaming detokenization, stop
strings (held back while they may still be forming), end-of-sequence ids, reasoning
channels, cancellation and statistics; its last item is the typed ``GenerationResult``.
In a batch it yields ``WAITING`` (``Signal.WAITING``, engine.decode.signals) whenever the
batch has no token for it yet: whoever drives it steps the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

from engine.api import FinishReason, GenerationParams, GenerationResult, GenerationStats, ToolCall
from engine.decode import speculative
from engine.decode.compiled_hybrid import compiled_decoder  # attention-only or hybrid stacks
from engine.decode.draft_depth import DraftDepth
from engine.decode.drafters import drafter_for
from engine.decode.guards import check_finite
from engine.decode.prefill import HISTORY_WINDOW, ProgressCallback, PromptInputs, prefill_head
from engine.decode.rolling import RollingWindow, rolling_tokens
from engine.decode.sampling import LogitsProcessor, Sampler, make_logits_processors, make_sampler
from engine.decode.signals import Signal, Token
from engine.decode.stats import StatsCounter
from engine.errors import EngineError


def generate_step(
    prompt: mx.array,
    model: Any,
    cache: Sequence[Any],
    *,
    max_tokens: int,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    logprobs: bool = False,
    prefill_chunk: int = 512,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    history: mx.array | None = None,
    inputs: PromptInputs | None = None,
    compiled: bool | None = None,
    top_logprobs: int = 0,
    top_sink: list[tuple[mx.array, mx.array]] | None = None,
) -> Iterator[tuple[int, float | None]]:
    """Yield ``(token_id, logprob or None)`` for up to ``max_tokens`` tokens.

    ``prompt`` holds the ids not yet in ``cache`` (at least one). The log-prob is the
    chosen token's under the model's own distribution, before any processor or
    temperature. Stops early (without raising) when ``cancel`` is set. ``history`` is
    the context logits processors look back over (default: ``prompt``). ``inputs``
    carries a multimodal prompt's embeddings and positions. ``compiled``
    lets decode steps run through the model's ``CompiledDecoder`` where it applies
    (same results, less per-token overhead); False forces the plain forward pass.
    None (default) compiles on a GPU only: the CPU build turns each fused kernel
    into C++ for a compiler, seconds per new kernel, for little gain there.
    With ``logprobs`` and ``top_logprobs`` > 0, each step also appends the ids and
    log-probs of its ``top_logprobs`` most likely tokens to ``top_sink``, in step order.
    """
    if prompt.size == 0:
        raise EngineError("nothing to generate from: the prompt has no tokens")
    if max_tokens <= 0:
        return
    sample = sampler or (lambda x: mx.argmax(x, axis=-1))
    processors = list(logits_processors)
    window = HISTORY_WINDOW
    recent = (history if history is not None else prompt)[-window:] if processors else None

    if compiled is None:
        compiled = mx.default_device() == mx.gpu
    # Multimodal RoPE (Qwen2.5-VL, Qwen3-VL) decodes text at the cache offset shifted by
    # the prompt's delta; media that only adds embeddings (Gemma 3, audio) decodes as text.
    shift = inputs.position_delta if inputs is not None and inputs.positions is not None else 0
    decoder = compiled_decoder(model) if compiled else None
    if decoder is not None and not decoder.prepare():
        decoder = None

    def forward(tokens: mx.array, kwargs: dict[str, Any] | None) -> mx.array:
        if decoder is not None and not kwargs:
            logits = decoder(tokens, cache, shift)
            if logits is not None:
                return logits
        if kwargs is None:
            kwargs = inputs.decode_kwargs(cache) if inputs is not None else {}
        return model(tokens[None], cache=cache, **kwargs)[:, -1, :]

    def step(
        tokens: mx.array, *, extend: bool, kwargs: dict[str, Any] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        nonlocal recent
        logits = forward(tokens, kwargs)
        processed = logits
        if processors:
            if extend:
                recent = mx.concatenate([recent, tokens])[-window:]
            for proc in processors:
                processed = proc(recent, processed)
        y = sample(processed)
        if not logprobs:
            # The chosen token's raw logit rides along for the NaN check: one element.
            return y, mx.take_along_axis(logits, y[:, None], axis=-1)[0, 0]
        raw = logits.astype(mx.float32)
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        if top_logprobs > 0 and top_sink is not None:
            k = min(top_logprobs, lp.shape[-1])
            top = mx.argpartition(-lp[0], kth=k - 1)[:k]
            top_sink.append((top, lp[0][top]))
        return y, mx.take_along_axis(lp, y[:, None], axis=-1)[0, 0]

    if not prefill_head(
        model, prompt, cache, chunk=prefill_chunk, cancel=cancel, on_progress=on_progress, inputs=inputs
    ):
        return
    if cancel is not None and cancel.is_set():
        return
    last = int(prompt.size) - 1
    y, lp = step(prompt[-1:], extend=False, kwargs=inputs.kwargs(last, last + 1) if inputs is not None else None)
    mx.async_eval([y, lp])
    n = 0
    while True:
        if n + 1 < max_tokens:
            # Queue the next step before waiting on this one: the device works on
            # token n+1 while Python hands token n out.
            next_y, next_lp = step(y, extend=True)
            mx.async_eval([next_y, next_lp])
        value = float(lp.item())  # a log-prob, or the raw logit when none was asked for
        check_finite(value)
        yield int(y.item()), (value if logprobs else None)
        n += 1
        if n >= max_tokens or (cancel is not None and cancel.is_set()):
            return
        y, lp = next_y, next_lp


# ---- text around the token loop -----------------------------------------------

# Yielded by stream_generate in a batch while its sequence waits for the batch's next step.
WAITING = Signal.WAITING


@dataclass
class Piece:
    """A run of new text on one channel, with the token ids that produced it (and, when
    asked for, their log-probs): every generated token is carried by exactly one piece.
    On the "tool" channel (engine.decode.tool_channel) it carries a call instead of text."""

    text: str
    channel: Literal["answer", "reasoning", "tool"]
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    tool_call: ToolCall | None = None


class StopStrings:
    """Finds stop strings in streamed text, even when split across tokens. Text that
    could still become a stop string is held back until it cannot."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class _Collector:
    answer: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def add(self, channel: str, text: str) -> None:
        (self.reasoning if channel == "reasoning" else self.answer).append(text)


class _Reply:
    """The text side of one reply: the ids as they come, their log-probs and top
    alternatives, streaming detokenization, stop strings, the reasoning split, the text
    per channel and the statistics. Every id rides on exactly one ``Piece``."""

    def __init__(
        self,
        tokenizer: Any,
        params: GenerationParams,
        reasoning: Any,
        stats: StatsCounter,
        tops: list[tuple[mx.array, mx.array]] | None,
    ) -> None:
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.stops = StopStrings(params.stop_strings)
        self.reasoning = reasoning
        self.stats = stats
        self.tops = tops
        self.collected = _Collector()
        self.ids: list[int] = []
        self.lps: list[float] | None = [] if params.logprobs else None
        self.top_rows: list[list[tuple[int, float]]] = []
        self.carried = 0  # ids[:carried] went out with earlier pieces
        self.first_at = 0.0  # when the first id came

    def take(self, token: int, lp: float | None, now: float, start: float, prompt_tokens: int) -> None:
        """Record one generated id (its stats timed from ``start``, the request's start)."""
        stats, ids = self.stats, self.ids
        if not ids:
            self.first_at = now
            stats.time_to_first_token = now - start
            stats.prompt_tps = prompt_tokens / max(now - start, 1e-9)
        ids.append(token)
        if self.lps is not None and lp is not None:
            self.lps.append(lp)
        if self.tops is not None and len(self.tops) >= len(ids):  # the plain loop fills it, drafting does not
            top_ids, top_lps = self.tops[len(ids) - 1]
            self.top_rows.append(list(zip(top_ids.tolist(), top_lps.tolist(), strict=True)))
        stats.generated_tokens = len(ids)
        if len(ids) > 1:
            stats.generation_tps = (len(ids) - 1) / max(now - self.first_at, 1e-9)

    def text_of(self, token: int) -> tuple[str, bool]:
        """The text ``token`` adds that is safe to emit, and whether a stop string completed."""
        return self.stops.push(self.detok.add(token) if self.detok is not None else "")

    def piece(self, text: str, channel: Any) -> Piece:
        # The tokens since the last piece (text held back, an end-of-turn id) ride on this one.
        start, self.carried = self.carried, len(self.ids)
        return Piece(
            text,
            channel,
            self.ids[start:],
            self.stats.snapshot(),
            logprobs=self.lps[start:] if self.lps is not None else None,
            top_logprobs=self.top_rows[start:] if self.tops is not None else None,
        )

    def emit(self, text: str) -> Iterator[Piece]:
        parts = self.reasoning.feed(text) if self.reasoning is not None else [("answer", text)]
        for channel, part in parts:
            if part:
                self.collected.add(channel, part)
                yield self.piece(part, channel)

    def close(self, by_stop_string: bool) -> Iterator[Piece]:
        """The text still held: bytes the detokenizer holds, text held back as a possible
        stop string that never completed, and what the reasoning splitter holds."""
        if not by_stop_string:
            text, by_stop_string = self.stops.push(self.detok.finalize() if self.detok is not None else "")
            if not by_stop_string:
                text += self.stops.flush()
            if text:
                yield from self.emit(text)
        if self.reasoning is not None:
            for channel, part in self.reasoning.flush():
                if part:
                    self.collected.add(channel, part)
                    yield self.piece(part, channel)

    def result(self, finish: FinishReason) -> GenerationResult:
        return GenerationResult(
            text="".join(self.collected.answer),
            reasoning="".join(self.collected.reasoning),
            token_ids=self.ids,
            token_logprobs=self.lps,
            finish_reason=finish,
            stats=self.stats.snapshot(),
            top_logprobs=self.top_rows if self.tops is not None else None,
        )


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    cache: Sequence[Any],
    params: GenerationParams,
    *,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    eos_token_ids: Iterable[int] | None = None,
    reasoning: Any = None,
    cached_tokens: int = 0,
    context_ids: Sequence[int] | None = None,
    drafter: Any = None,
    inputs: PromptInputs | None = None,
    batch: Any = None,
    rolling: RollingWindow | None = None,
) -> Iterator[Piece | GenerationResult | Signal]:
    """Generate from ``prompt_ids`` (the ids not yet in ``cache``; ``cached_tokens`` more
    are already there). Yields ``Piece`` items as text forms; the last item is the
    ``GenerationResult``. ``tokenizer`` may be None (ids only, no text). ``reasoning`` is
    an optional splitter with ``feed(text) -> [(channel, text)]`` and ``flush()``.
    ``context_ids`` is the whole prompt (cached part included) for the repetition penalty.
    ``drafter`` (an ``engine.decode.speculative`` drafter) turns on speculative decoding; without one,
    ``params.speculative == "ngram"`` builds an n-gram drafter here. ``batch`` (a
    ``Batch``; plain text prompts, no drafter) decodes among other sequences; the stream
    then also yields ``WAITING``. ``rolling`` (a text prompt decoded plainly) lets the reply
    go past the context by sliding the window (``params.max_tokens`` is then the whole reply)."""
    cancel = cancel or threading.Event()
    sp = params.sampling
    sampler = make_sampler(sp)
    processors = make_logits_processors(sp)
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ()
    eos = set() if params.ignore_eos else set(int(i) for i in eos_token_ids)
    if params.constraint is not None:
        from engine.decode.constrained import make_constraint_processor

        # Last, so it masks what the other processors left: the output always matches.
        processors.append(make_constraint_processor(params.constraint, tokenizer, sorted(eos)))
    tops: list[tuple[mx.array, mx.array]] | None = [] if params.logprobs and params.top_logprobs > 0 else None
    stats = StatsCounter(prompt_tokens=len(prompt_ids) + cached_tokens, cached_tokens=cached_tokens)
    reply = _Reply(tokenizer, params, reasoning, stats, tops)
    finish: FinishReason = "length"
    mx.reset_peak_memory()
    start = time.perf_counter()
    tokens = token_source(
        model,
        cache,
        prompt_ids,
        params,
        sampler=sampler,
        processors=processors,
        stats=stats,
        tops=tops,
        cancel=cancel,
        on_progress=on_progress,
        context_ids=context_ids,
        drafter=drafter,
        inputs=inputs,
        batch=batch,
        rolling=rolling,
    )
    by_stop_string = False
    for item in tokens:
        if item is Signal.WAITING:  # a batched sequence waiting for the batch's next step
            yield WAITING
            continue
        token, lp = item
        reply.take(token, lp, time.perf_counter(), start, len(prompt_ids))
        if token in eos:
            finish = "stop"
            break
        text, by_stop_string = reply.text_of(token)
        if text:
            yield from reply.emit(text)
        if by_stop_string:
            finish = "stop"
            break
        if cancel.is_set():
            finish = "cancelled"
            break
    else:
        if cancel.is_set() and len(reply.ids) < params.max_tokens:
            finish = "cancelled"
    tokens.close()
    yield from reply.close(by_stop_string)
    stats.peak_memory_bytes = int(mx.get_peak_memory())
    yield reply.result(finish)


def token_source(
    model: Any,
    cache: Sequence[Any],
    prompt_ids: Sequence[int],
    params: GenerationParams,
    *,
    sampler: Sampler,
    processors: list[LogitsProcessor],
    stats: StatsCounter,
    tops: list[tuple[mx.array, mx.array]] | None,
    cancel: threading.Event,
    on_progress: ProgressCallback | None,
    context_ids: Sequence[int] | None,
    drafter: Any,
    inputs: PromptInputs | None,
    batch: Any,
    rolling: RollingWindow | None,
) -> Generator[Token | Signal, None, None]:
    """The one place that picks where a request's tokens come from (each a generator: the
    ones not picked are never built):

    * a batch row (``batch``: plain text prompts, no drafter), which also yields
      ``Signal.WAITING`` while the batch has no token for it yet;
    * speculative decoding (``drafter``, or one ``params.speculative`` names): drafts
      verified by the target, drafts counted in ``stats``. Constrained output decodes
      plainly: the grammar matcher follows one token at a time and cannot take drafts back.
      Media that only replaces prompt embeddings (Gemma 3 images, audio) goes into the
      target's prefill; drafters work on the ids, placeholders included; after multimodal
      RoPE (Qwen2.5-VL, Qwen3-VL) verification passes take the shifted positions;
    * the rolling window (``rolling``, a text prompt decoded plainly): the reply slides
      the window along when it fills the context (engine.decode.rolling);
    * the plain loop (``generate_step``).

    Diffusion models decode whole blocks, not tokens: the session gives their requests
    to ``engine.decode.diffusion.stream_diffusion`` instead."""
    if drafter is None and params.speculative is not None:
        drafter = drafter_for(params)
    if params.constraint is not None:
        drafter = None
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    history = mx.array(list(context_ids), dtype=mx.uint32) if context_ids else None
    if batch is not None:
        if drafter is not None or inputs is not None:
            raise EngineError("speculative decoding and media prompts decode one request at a time")
        return batch.sequence(
            prompt,
            cache,
            max_tokens=params.max_tokens,
            sampler=sampler,
            greedy=params.sampling.temperature <= 0,
            logits_processors=processors,
            logprobs=params.logprobs,
            prefill_chunk=params.prefill_chunk,
            cancel=cancel,
            on_progress=on_progress,
            history=history,
            top_logprobs=params.top_logprobs,
            top_sink=tops,
        )
    if drafter is not None:
        return speculative.speculative_step(
            list(prompt_ids),
            model,
            cache,
            drafter,
            max_tokens=params.max_tokens,
            sampling=params.sampling,
            logits_processors=processors,
            logprobs=params.logprobs,
            num_draft_tokens=params.num_draft_tokens,
            depth=DraftDepth(drafter.max_draft) if params.num_draft_tokens is None else None,
            stats=stats,
            prefill_chunk=params.prefill_chunk,
            cancel=cancel,
            history=list(context_ids) if context_ids else None,
            on_progress=on_progress,
            inputs=inputs,
        )

    def plain(prompt: mx.array, max_tokens: int, history: mx.array | None) -> Iterator[Token]:
        return generate_step(
            prompt,
            model,
            cache,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            logprobs=params.logprobs,
            prefill_chunk=params.prefill_chunk,
            cancel=cancel,
            on_progress=on_progress,
            history=history,
            inputs=inputs,
            top_logprobs=params.top_logprobs,
            top_sink=tops,
        )

    if rolling is not None and inputs is None:
        whole = list(context_ids) if context_ids else list(prompt_ids)
        return rolling_tokens(
            rolling,
            whole,
            params.max_tokens,
            plain(prompt, min(params.max_tokens, rolling.limit - len(whole)), history),
            lambda kept, cached, room: plain(
                mx.array(kept[cached:], dtype=mx.uint32), room, mx.array(kept, dtype=mx.uint32)
            ),
            list(cache),
            cancel,
        )
    return plain(prompt, params.max_tokens, history)


def generate(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    cache: Sequence[Any],
    params: GenerationParams,
    **kwargs: Any,
) -> GenerationResult:
    """Run ``stream_generate`` to the end and return its result."""
    result = None
    for item in stream_generate(model, tokenizer, prompt_ids, cache, params, **kwargs):
        if isinstance(item, GenerationResult):
            result = item
    assert result is not None
    return result
