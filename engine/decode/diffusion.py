"""Block diffusion decoding (DiffusionGemma), as transformers 5.23's ``generate`` does it.

Blocks of ``canvas_length`` tokens are written one after another. For each block the
encoder first adds the tokens so far to the cache (the whole prompt, then each
finished block), then the canvas, starting from uniformly random tokens, is denoised
for up to ``steps`` steps, counting down from N to 1:

1. the decoder gives logits for the canvas, self-conditioned on the previous step's
   (temperature-scaled) logits;
2. the logits are divided by a temperature falling linearly with the steps left,
   ``t_min + (t_max - t_min) * step / N``;
3. a token is sampled at every position; the positions of lowest entropy are accepted,
   as many as keep ``sum(entropies) - max(entropy) <= entropy_bound`` (the
   entropy-bound sampler), the others keep their canvas token;
4. every position not accepted this step is renoised with a fresh random token;
5. the block stops early once the argmax canvas has not changed for
   ``stability_threshold`` steps and the mean entropy is below ``confidence_threshold``.

The block's tokens are the argmax of the last step's logits. A block holding an
end-of-sequence id ends the generation; its tokens after the first one become padding.
Whole blocks are written, so the reply may run past ``max_tokens`` to the block's end,
as in transformers.

Randomness comes from a ``Noise`` (the canvases and the categorical samples): MLX's
generator by default, or recorded draws replayed, which is how the tests hold this loop
to transformers' ids for the same draws.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from engine.api import GenerationResult
from engine.decode.loop import Piece
from engine.decode.stats import StatsCounter
from engine.errors import EngineError
from engine.models.stacked import stack_projections


@dataclass(frozen=True)
class DiffusionSettings:
    """transformers' ``DiffusionGemmaGenerationConfig`` defaults; a checkpoint's
    generation_config.json overrides them (``from_generation_config``)."""

    steps: int = 48  # max_denoising_steps
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    @classmethod
    def from_generation_config(cls, config: dict[str, Any] | None) -> DiffusionSettings:
        config = config or {}
        sampler = config.get("sampler_config") or {}
        values = dict(
            steps=config.get("max_denoising_steps"),
            entropy_bound=sampler.get("entropy_bound") if isinstance(sampler, dict) else None,
            t_min=config.get("t_min"),
            t_max=config.get("t_max"),
            stability_threshold=config.get("stability_threshold"),
            confidence_threshold=config.get("confidence_threshold"),
        )
        return cls(**{k: v for k, v in values.items() if v is not None}).checked()

    def checked(self) -> DiffusionSettings:
        if self.steps <= 0:
            raise EngineError(f"Denoising steps must be a positive number (got {self.steps}).")
        if self.entropy_bound <= 0:
            raise EngineError(f"The entropy bound must be above 0 (got {self.entropy_bound}).")
        if not 0 <= self.t_min < self.t_max:
            raise EngineError(f"The temperatures need 0 <= t_min < t_max (got {self.t_min}, {self.t_max}).")
        return self


class Noise(Protocol):
    def canvas(self, length: int, vocab: int) -> mx.array: ...

    def sample(self, logits: mx.array) -> mx.array:
        """One token per position from softmax(``logits``) [canvas, vocab]."""
        ...


class RandomNoise:
    """MLX's generator, seeded (a seed gives the same reply every time)."""

    def __init__(self, seed: int | None = None):
        self.key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    def _next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def canvas(self, length: int, vocab: int) -> mx.array:
        return mx.random.randint(0, vocab, (length,), key=self._next())

    def sample(self, logits: mx.array) -> mx.array:
        return mx.random.categorical(logits, key=self._next())


@dataclass
class ReplayedNoise:
    """Recorded draws, handed out in order (canvases and samples each their own queue)."""

    canvases: list[list[int]]
    samples: list[list[int]]

    def canvas(self, length: int, vocab: int) -> mx.array:
        if not self.canvases:
            raise EngineError("the recorded canvases ran out")
        return mx.array(self.canvases.pop(0))

    def sample(self, logits: mx.array) -> mx.array:
        if not self.samples:
            raise EngineError("the recorded samples ran out")
        return mx.array(self.samples.pop(0))


@dataclass
class Block:
    """One finished block: its tokens (padding after an end-of-sequence dropped), the
    steps it took, and whether it ended the generation."""

    tokens: list[int]
    steps: int
    finished: bool
    raw: list[int] = field(default_factory=list)  # all canvas_length ids, padding included


def _entropy(logits: mx.array) -> mx.array:
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.exp(logp) * logp).sum(axis=-1)


@dataclass
class Canvas:
    """The block being denoised, after one step: the argmax ids so far (not settled)."""

    ids: mx.array
    step: int  # steps taken on this block
    steps: int  # the most it may take


def denoise_steps(
    model: Any, cache: list, settings: DiffusionSettings, noise: Noise, cancel: threading.Event | None = None
) -> Iterator[Canvas]:
    """Denoise the next block after what ``cache`` holds, yielding its argmax canvas after
    each step; the last one yielded is the block's result."""
    length, vocab = model.canvas_length, model.args.vocab_size
    canvas = noise.canvas(length, vocab)
    history = [mx.full((length,), -1, dtype=mx.int32)] * settings.stability_threshold
    previous: mx.array | None = None
    taken = 0
    for step in range(settings.steps, 0, -1):
        if cancel is not None and cancel.is_set():
            if not taken:  # cut short before the first step: the starting canvas stands
                yield Canvas(canvas, 0, settings.steps)
            break
        raw = model.denoise(canvas[None], cache, previous)[0]
        temperature = settings.t_min + (settings.t_max - settings.t_min) * (step / settings.steps)
        logits = raw / temperature
        sampled = noise.sample(logits).astype(canvas.dtype)
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32)
        # Accept the lowest-entropy positions while their summed entropy, less the largest, stays in bound.
        entropy = _entropy(logits)
        order = mx.argsort(entropy)
        ranked = entropy[order]
        keep_ranked = (mx.cumsum(ranked) - ranked) <= settings.entropy_bound
        accepted = keep_ranked[mx.argsort(order)]  # back to canvas order
        kept = mx.where(accepted, sampled, canvas)
        canvas = mx.where(accepted, kept, noise.canvas(length, vocab).astype(canvas.dtype))
        taken += 1
        stable = all(mx.array_equal(h, argmax).item() for h in history)
        if history:
            history = history[1:] + [argmax]
        confident = mx.mean(entropy).item() < settings.confidence_threshold
        previous = logits
        yield Canvas(argmax, taken, settings.steps)
        if stable and confident:
            break


def diffuse(
    model: Any,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    settings: DiffusionSettings,
    noise: Noise,
    eos_ids: Sequence[int] = (),
    pad_id: int | None = None,
    cancel: threading.Event | None = None,
    cache: list | None = None,
    drafts: bool = False,
    inputs: Any = None,
    on_encoded: Any = None,
) -> Iterator[Block | Canvas]:
    """Yield each finished block after ``prompt`` (ids not yet in ``cache``) until an
    end-of-sequence id, ``max_tokens`` (rounded up to whole blocks) or ``cancel``; with
    ``drafts``, also the block's canvas after each denoising step, before the block.
    ``inputs`` (engine.decode.prefill.PromptInputs) carries the prompt's embeddings with
    images spliced in, and each image's run of tokens; ``on_encoded()`` is called once the
    prompt is in the cache."""
    if not prompt:
        raise EngineError("nothing to generate from: the prompt has no tokens")
    stack_projections(model)  # gate and up experts as one product (engine/models/stacked.py)
    cache = model.make_cache() if cache is None else cache
    pending = mx.array([list(prompt)])
    stops = set(int(t) for t in eos_ids)
    blocks = -(-max(max_tokens, 0) // model.canvas_length)
    for _ in range(blocks):
        if cancel is not None and cancel.is_set():
            return
        if inputs is not None and inputs.embeddings is not None:
            model.encode(pending, cache, inputs.embeddings[None], inputs.blocks)
            inputs = None  # the prompt only: blocks are plain ids
        else:
            model.encode(pending, cache)
        if on_encoded is not None:
            on_encoded()
            on_encoded = None
        last = None
        for last in denoise_steps(model, cache, settings, noise, cancel):
            if drafts and last.step:
                yield last
        assert last is not None  # every run yields at least once (steps >= 1)
        ids, steps = last.ids, last.step
        if cancel is not None and cancel.is_set():
            return  # a block cut short is not a finished one
        raw = [int(t) for t in ids.tolist()]
        end = next((i for i, t in enumerate(raw) if t in stops), None)
        if end is not None:
            tail = [pad_id] * (len(raw) - end - 1) if pad_id is not None else raw[end + 1 :]
            yield Block(tokens=raw[:end], steps=steps, finished=True, raw=raw[: end + 1] + tail)
            return
        yield Block(tokens=raw, steps=steps, finished=False, raw=raw)
        pending = ids[None]


# A refining block is handed out after its first step, then at most this often: the chat
# view repaints every 33 ms, and each draft costs a decode of the whole canvas.
DRAFT_INTERVAL_S = 0.05


@dataclass
class Draft:
    """The block being denoised, as text: not settled. Each draft replaces the one before;
    the block's own Piece (its settled text) follows the last one. Split as the settled
    text is: ``text`` is the answer part, ``reasoning`` the thinking part, markers left out."""

    text: str
    step: int  # denoising steps taken on this block
    steps: int  # the most it may take
    reasoning: str = ""


def split_draft(reasoning: Any, text: str) -> tuple[str, str]:
    """A refining block's text split as its settled text will be: (answer, reasoning), the
    thinking markers left out. The splitter is fed on a copy: a draft is not settled, so it
    must not move the reply's splitter on (the block's settled text does that). A tail that
    may still grow into a marker is held back, as for settled text."""
    if reasoning is None:
        return text, ""
    parts = {"answer": "", "reasoning": ""}
    for channel, part in copy.deepcopy(reasoning).feed(text):
        parts[channel] += part
    return parts["answer"], parts["reasoning"]


def is_diffusion_model(model: Any) -> bool:
    """Whether ``model`` writes by denoising blocks (the host's choice of decode loop)."""
    return callable(getattr(model, "denoise", None)) and callable(getattr(model, "encode", None))


def stream_diffusion(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    cache: list | None,
    params: Any,
    *,
    cancel: threading.Event | None = None,
    eos_token_ids: Sequence[int] | None = None,
    reasoning: Any = None,
    cached_tokens: int = 0,
    drafter: Any = None,
    settings: DiffusionSettings | None = None,
    inputs: Any = None,
) -> Iterator[Any]:
    """``stream_generate``'s counterpart for block diffusion: one text piece per finished
    block (so a reply grows block by block), before it ``Draft``s of the block as it
    refines (throttled by ``DRAFT_INTERVAL_S``), then the ``GenerationResult`` with the
    denoising steps taken. ``cache`` None starts a fresh one."""

    if drafter is not None or params.speculative is not None:
        raise EngineError(
            "DiffusionGemma writes whole blocks by denoising; speculative decoding and draft "
            "models do not apply to it: turn Draft off."
        )
    if params.constraint is not None or params.logprobs:
        raise EngineError(
            "DiffusionGemma writes whole blocks at once: constrained output and log-probs are not available for it."
        )
    settings = settings or getattr(model, "diffusion_settings", None) or DiffusionSettings()
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ()
    eos = () if params.ignore_eos else tuple(int(i) for i in eos_token_ids)
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    stats = StatsCounter(prompt_tokens=len(prompt_ids) + cached_tokens, cached_tokens=cached_tokens)
    ids: list[int] = []
    texts = {"answer": "", "reasoning": ""}
    start = time.perf_counter()
    finish = "length"
    per_block: list[int] = []  # denoising steps of each finished block

    def pieces(text: str, tokens: list[int]) -> Iterator[Piece]:
        parts = reasoning.feed(text) if reasoning is not None else [("answer", text)]
        carried = list(tokens)
        for channel, part in parts:
            if part:
                texts[channel] += part
                yield Piece(part, channel, carried, stats.snapshot())
                carried = []
        if carried:  # a block whose text is held back still hands its ids out
            yield Piece("", "answer", carried, stats.snapshot())

    noise = RandomNoise(params.sampling.seed)
    drafted = 0.0

    def encoded() -> None:  # the encoder evaluates the cache, so the clock has seen the work
        stats.prompt_tps = len(prompt_ids) / max(time.perf_counter() - start, 1e-9)

    for block in diffuse(
        model,
        prompt_ids,
        max_tokens=params.max_tokens,
        settings=settings,
        noise=noise,
        eos_ids=eos,
        cancel=cancel,
        cache=cache,
        drafts=tokenizer is not None,
        inputs=inputs,
        on_encoded=encoded,
    ):
        if isinstance(block, Canvas):
            now = time.perf_counter()
            if block.step == 1 or now - drafted >= DRAFT_INTERVAL_S:
                drafted = now
                canvas = [int(t) for t in block.ids.tolist()]
                end = next((i for i, t in enumerate(canvas) if t in eos), len(canvas))
                answer, thought = split_draft(reasoning, tokenizer.decode(canvas[:end]))
                yield Draft(answer, block.step, block.steps, thought)
            continue
        if not ids:
            stats.time_to_first_token = time.perf_counter() - start
        ids += block.tokens
        per_block.append(block.steps)
        stats.generated_tokens = len(ids)
        stats.generation_tps = len(ids) / max(time.perf_counter() - start, 1e-9)
        text = "".join(detok.add(t) for t in block.tokens) if detok is not None else ""
        yield from pieces(text, block.tokens)
        if block.finished:
            finish = "stop"
    if cancel is not None and cancel.is_set():
        finish = "cancelled"
    tail = detok.finalize() if detok is not None else ""
    if tail:
        yield from pieces(tail, [])
    stats.peak_memory_bytes = int(mx.get_peak_memory())
    result = GenerationResult(
        text=texts["answer"],
        reasoning=texts["reasoning"],
        token_ids=ids,
        token_logprobs=None,
        finish_reason=finish,
        stats=stats.snapshot(),
        denoising_steps=sum(per_block),
        denoising_steps_per_block=per_block,
    )
    yield result
