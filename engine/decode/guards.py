"""Limits every request meets, whatever its caller: the model's context, finite
sampling settings, finite logits.

The model's context is a hard limit: a prompt that does not fit is refused before any
prefill (one line with both numbers), and a reply stops at the context (finish reason
``length``) whatever ``max_tokens`` says. Damaged weights show up as NaN or infinite
logits; the decode loop checks the chosen token's raw logit, a value it computes anyway,
so the check costs one gathered element per step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from engine.api import GenerationParams, SamplingParams
from engine.errors import EngineError

# Sampling settings past these mean nothing a person could want (and overflow the maths).
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_SEED = 2**64 - 1

DAMAGED_WEIGHTS = "the model produced NaN: its weights look damaged"


class ContextTooLong(EngineError):
    """The prompt (or chat) does not fit in the model's context."""

    def __init__(self, tokens: int, context: int, what: str = "prompt"):
        self.tokens, self.context = tokens, context
        advice = (
            "start a new chat, or shorten or delete earlier messages"
            if what == "chat"
            else "shorten it, or use a model with a longer context"
        )
        article = "this" if what == "chat" else "the"
        super().__init__(
            f"{article.capitalize()} {what} is too long for the model's context "
            f"({tokens:,} tokens of {context:,}): {advice}."
        )


class NonFiniteLogits(EngineError):
    """The model produced NaN or infinite logits."""

    def __init__(self) -> None:
        super().__init__(f"{DAMAGED_WEIGHTS} (check the file or download it again)")


def check_fits(prompt_tokens: int, context: int, what: str = "prompt") -> None:
    """Refuse a prompt that leaves no room for one token of reply; ``context`` 0 is unknown."""
    if context > 0 and prompt_tokens >= context:
        raise ContextTooLong(prompt_tokens, context, what)


def fit_context(params: GenerationParams, prompt_tokens: int, context: int) -> GenerationParams:
    """``params`` with ``max_tokens`` cut to what the context has left after the prompt."""
    check_fits(prompt_tokens, context)
    if context > 0 and params.max_tokens > context - prompt_tokens:
        return replace(params, max_tokens=context - prompt_tokens)
    return params


def check_sampling_values(params: SamplingParams) -> None:
    """Refuse NaN, infinities and absurd magnitudes in sampling settings, one line each."""
    for name, value in (
        ("temperature", params.temperature),
        ("top-p", params.top_p),
        ("min-p", params.min_p),
        ("repetition penalty", params.repetition_penalty),
    ):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EngineError(f"{name} must be a finite number (got {value})")
    if params.temperature > MAX_TEMPERATURE:
        raise EngineError(
            f"temperature must be at most {MAX_TEMPERATURE:g} (got {params.temperature:g}); 0 is greedy, 0.7-1 is usual"
        )
    if params.repetition_penalty > MAX_REPETITION_PENALTY:
        raise EngineError(
            f"repetition penalty must be at most {MAX_REPETITION_PENALTY:g} "
            f"(got {params.repetition_penalty:g}); 1.0 turns it off"
        )
    if params.repetition_context < 0:
        raise EngineError(f"repetition context must be >= 0 (got {params.repetition_context})")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise EngineError(f"seed must be between 0 and 2**64-1 (got {params.seed})")


def check_finite(value: float) -> None:
    """The chosen token's raw logit: NaN or infinite means the weights are damaged."""
    if not math.isfinite(value):
        raise NonFiniteLogits()


def check_utf8(text: str | None, what: str) -> None:
    """Refuse text that holds bytes which are not UTF-8 (command lines carry them as
    lone surrogates), naming where, before a tokenizer chokes on them."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EngineError(
            f"{what} is not valid UTF-8 text (a stray byte at character {e.start}); give UTF-8 text"
        ) from None
