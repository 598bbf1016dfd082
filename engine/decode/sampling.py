"""Samplers and logits processors, built as closures over one request's settings.

A sampler maps log-probabilities of shape (batch, vocab) to token ids of shape (batch,).
Every request carries its own random key (seeded from ``SamplingParams.seed``, or from
the OS when no seed is given) and splits it once per step, so two requests never share
random state and a seeded request is reproducible whatever else runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import mlx.core as mx

from engine.api import SamplingParams
from engine.decode.guards import check_sampling_values
from engine.errors import EngineError

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

_NEG_INF = float("-inf")


def _mask_top_k(logits: mx.array, k: int) -> mx.array:
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    # Everything outside the k largest is dropped; ties at the boundary keep exactly k.
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(_NEG_INF, logits.dtype), axis=-1)


def _mask_top_p(logits: mx.array, p: float) -> mx.array:
    if p >= 1.0:
        return logits
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # Keep the smallest set whose mass reaches p: a token stays when the mass strictly
    # above it is still short of p (so the top token always stays).
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, _NEG_INF)


def _mask_min_p(logits: mx.array, min_p: float) -> mx.array:
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    threshold = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= threshold, logits, _NEG_INF)


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature-scaled logits with top-k, then top-p, then min-p applied (as transformers
    orders them). Dropped tokens are -inf; the result is what the sampler draws from."""
    scaled = logits * (1.0 / params.temperature) if params.temperature > 0 else logits
    scaled = _mask_top_k(scaled, params.top_k)
    scaled = _mask_top_p(scaled, params.top_p)
    return _mask_min_p(scaled, params.min_p)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler for one request. Temperature 0 is argmax (no random state at all)."""
    if params.temperature <= 0:
        return _greedy

    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    state = [mx.random.key(seed)]
    # Filters and the draw are one compiled graph: fewer Python-built ops per step.
    filtered = mx.compile(lambda lp: filter_logits(lp, params))

    def draw(kept: mx.array) -> mx.array:
        """The draw from logits already filtered (this request's random key, split)."""
        key, step_key = mx.random.split(state[0])
        state[0] = key
        return mx.random.categorical(kept, axis=-1, key=step_key)

    def sample(logprobs: mx.array) -> mx.array:
        return draw(filtered(logprobs))

    # A batch filters the rows that share these settings together, then draws each with
    # its own key (engine.decode.batch): the same tokens as this sampler alone.
    sample.filter_key = (params.temperature, params.top_k, params.top_p, params.min_p)  # type: ignore[attr-defined]
    sample.filtered = filtered  # type: ignore[attr-defined]
    sample.draw = draw  # type: ignore[attr-defined]
    return sample


def make_repetition_penalty(penalty: float, context: int) -> LogitsProcessor:
    """Divide positive logits (multiply negative ones) of tokens seen in the last
    ``context`` ids by ``penalty``, as in the CTRL paper and transformers."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        recent = tokens[-context:].reshape(1, -1) if context > 0 else tokens.reshape(1, -1)
        recent = mx.broadcast_to(recent, (logits.shape[0], recent.shape[-1]))
        seen = mx.take_along_axis(logits, recent, axis=-1)
        seen = mx.where(seen < 0, seen * penalty, seen / penalty)
        return mx.put_along_axis(logits, recent, seen, axis=-1)

    return process


def make_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Processors applied to raw logits before sampling, each ``(tokens, logits) -> logits``
    where ``tokens`` holds the prompt and the tokens generated so far."""
    validate_sampling(params)
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty and params.repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(params.repetition_penalty, params.repetition_context))
    return processors


def validate_sampling(params: SamplingParams) -> None:
    """Refuse settings that cannot mean anything, with a line that says which."""
    check_sampling_values(params)  # NaN, infinities, absurd magnitudes
    if params.temperature < 0:
        raise EngineError(f"temperature must be >= 0 (got {params.temperature})")
    if not 0.0 < params.top_p <= 1.0:
        raise EngineError(f"top-p must be in (0, 1] (got {params.top_p})")
    if params.top_k < 0:
        raise EngineError(f"top-k must be >= 0 (got {params.top_k})")
    if not 0.0 <= params.min_p <= 1.0:
        raise EngineError(f"min-p must be in [0, 1] (got {params.min_p})")
    if params.repetition_penalty <= 0:
        raise EngineError(f"repetition penalty must be > 0 (got {params.repetition_penalty}); 1.0 turns it off")
