"""The decode loop: chunked prefill, pipelined decoding, stop conditions, stats.

``generate_step`` is the bare token loop. It keeps the device busy by queueing step
n+1 (``mx.async_eval``) before it waits for token n, builds only the ops a request needs
(no log-softmax unless log-probs are asked for or the sampler needs them), and never
synchronises except to read the one token it yields.

``stream_generate`` wraps it with text: streaming detokenization, stop strings (held
back while they may still be forming), end-of-sequence ids, reasoning channels,
cancellation and statistics; its last item is the typed ``GenerationResult``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

from .api import GenerationParams, GenerationResult, GenerationStats, FinishReason
from .errors import EngineError
from .fast_decode import compiled_decoder
from .guards import check_finite
from .sampling import LogitsProcessor, Sampler, make_logits_processors, make_sampler

ProgressCallback = Callable[[int, int], None]

# How far back logits processors (repetition penalty) may look.
HISTORY_WINDOW = 1024


def _cache_arrays(cache: Sequence[Any]) -> list[Any]:
    return [c.state for c in cache]


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
) -> bool:
    """Feed ``prompt`` (1-D ids) into ``cache`` in chunks. Only the cache is evaluated,
    never the logits of the chunk. Returns False when cancelled between chunks."""
    total = int(prompt.size)
    chunk = max(1, chunk)
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
    return True


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
    # Multimodal RoPE (Qwen2.5-VL) decodes at shifted positions the compiled step does not
    # model; media that only adds embeddings (Gemma 3, audio models) decodes as text does.
    decoder = compiled_decoder(model) if compiled and (inputs is None or inputs.positions is None) else None
    if decoder is not None and not decoder.prepare():
        decoder = None

    def forward(tokens: mx.array, kwargs: dict[str, Any]) -> mx.array:
        if decoder is not None and not kwargs:
            logits = decoder(tokens, cache)
            if logits is not None:
                return logits
        return model(tokens[None], cache=cache, **kwargs)[:, -1, :]

    def step(tokens: mx.array, *, extend: bool, kwargs: dict[str, Any] | None = None) -> tuple[mx.array, mx.array | None]:
        nonlocal recent
        if kwargs is None:
            kwargs = inputs.decode_kwargs(cache) if inputs is not None else {}
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
        return y, mx.take_along_axis(lp, y[:, None], axis=-1)[0, 0]

    if not prefill(
        model, prompt[:-1], cache, chunk=prefill_chunk, cancel=cancel, on_progress=on_progress, inputs=inputs
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


@dataclass
class Piece:
    """A run of new text on one channel, with the token ids that produced it."""

    text: str
    channel: Literal["answer", "reasoning"]
    token_ids: list[int]
    stats: GenerationStats


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
) -> Iterator[Piece | GenerationResult]:
    """Generate from ``prompt_ids`` (the ids not yet in ``cache``; ``cached_tokens`` more
    are already there). Yields ``Piece`` items as text forms; the last item is the
    ``GenerationResult``. ``tokenizer`` may be None (ids only, no text). ``reasoning`` is
    an optional splitter with ``feed(text) -> [(channel, text)]`` and ``flush()``.
    ``context_ids`` is the whole prompt (cached part included) for the repetition penalty.
    ``drafter`` (an ``engine.speculative`` drafter) turns on speculative decoding; without one,
    ``params.speculative == "ngram"`` builds an n-gram drafter here."""
    cancel = cancel or threading.Event()
    sp = params.sampling
    sampler = make_sampler(sp)
    processors = make_logits_processors(sp)
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ()
    eos = set() if params.ignore_eos else set(int(i) for i in eos_token_ids)
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    stops = StopStrings(params.stop_strings)
    collected = _Collector()

    stats = GenerationStats(prompt_tokens=len(prompt_ids) + cached_tokens, cached_tokens=cached_tokens)
    ids: list[int] = []
    lps: list[float] | None = [] if params.logprobs else None
    finish: FinishReason = "length"
    mx.reset_peak_memory()
    start = time.perf_counter()
    first_at = start

    def emit(text: str, token_ids: list[int]) -> Iterator[Piece]:
        parts = reasoning.feed(text) if reasoning is not None else [("answer", text)]
        for channel, part in parts:
            if part:
                collected.add(channel, part)
                yield Piece(part, channel, token_ids, stats)

    if drafter is None and params.speculative is not None:
        drafter = _drafter_for(params)
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    tokens = generate_step(
        prompt,
        model,
        cache,
        max_tokens=params.max_tokens,
        sampler=sampler,
        logits_processors=processors,
        logprobs=params.logprobs,
        prefill_chunk=params.prefill_chunk,
        cancel=cancel,
        on_progress=on_progress,
        history=mx.array(list(context_ids), dtype=mx.uint32) if context_ids else None,
        inputs=inputs,
    )
    # Speculative decoding stands in for the plain loop (a generator: never started, costs
    # nothing). Media that only replaces prompt embeddings (Gemma 3 images, audio) goes into
    # the target's prefill; drafters work on the ids, placeholders included. Multimodal RoPE
    # (Qwen2.5-VL: inputs.positions) decodes plainly: its replies continue at positions
    # shifted by the media, which verification passes and draft models know nothing of.
    if drafter is not None and (inputs is None or inputs.positions is None):
        tokens = _speculative_tokens(
            prompt_ids, model, cache, drafter, params, processors, stats, cancel, on_progress, context_ids,
            inputs,
        )
    by_stop_string = False
    for token, lp in tokens:
        now = time.perf_counter()
        if not ids:
            first_at = now
            stats.time_to_first_token = now - start
            stats.prompt_tps = len(prompt_ids) / max(now - start, 1e-9)
        ids.append(token)
        if lps is not None and lp is not None:
            lps.append(lp)
        stats.generated_tokens = len(ids)
        if len(ids) > 1:
            stats.generation_tps = (len(ids) - 1) / max(now - first_at, 1e-9)
        if token in eos:
            finish = "stop"
            break
        text, by_stop_string = stops.push(detok.add(token) if detok is not None else "")
        if text:
            yield from emit(text, [token])
        if by_stop_string:
            finish = "stop"
            break
        if cancel.is_set():
            finish = "cancelled"
            break
    else:
        if cancel.is_set() and len(ids) < params.max_tokens:
            finish = "cancelled"
    tokens.close()

    if not by_stop_string:
        # Bytes the detokenizer still holds, and text held back as a possible stop string
        # that never completed.
        text, by_stop_string = stops.push(detok.finalize() if detok is not None else "")
        if not by_stop_string:
            text += stops.flush()
        if text:
            yield from emit(text, [])
    if reasoning is not None:
        for channel, part in reasoning.flush():
            if part:
                collected.add(channel, part)
                yield Piece(part, channel, [], stats)

    stats.peak_memory_bytes = int(mx.get_peak_memory())
    yield GenerationResult(
        text="".join(collected.answer),
        reasoning="".join(collected.reasoning),
        token_ids=ids,
        token_logprobs=lps,
        finish_reason=finish,
        stats=stats,
    )


def _drafter_for(params: GenerationParams) -> Any:
    from .drafters import make_drafter

    return make_drafter(
        params.speculative, ngram_size=params.ngram_size, num_draft_tokens=params.num_draft_tokens,
        prefill_chunk=params.prefill_chunk,
    )


def _speculative_tokens(
    prompt_ids: Sequence[int],
    model: Any,
    cache: Sequence[Any],
    drafter: Any,
    params: GenerationParams,
    processors: Sequence[LogitsProcessor],
    stats: GenerationStats,
    cancel: threading.Event | None,
    on_progress: ProgressCallback | None,
    context_ids: Sequence[int] | None,
    inputs: PromptInputs | None,
) -> Iterator[tuple[int, float | None]]:
    """The speculative counterpart of ``generate_step``: same yields, drafts counted in ``stats``."""
    from .speculative import speculative_step

    return speculative_step(
        list(prompt_ids),
        model,
        cache,
        drafter,
        max_tokens=params.max_tokens,
        sampling=params.sampling,
        logits_processors=processors,
        logprobs=params.logprobs,
        num_draft_tokens=params.num_draft_tokens,
        stats=stats,
        prefill_chunk=params.prefill_chunk,
        cancel=cancel,
        history=list(context_ids) if context_ids else None,
        on_progress=on_progress,
        inputs=inputs,
    )


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
