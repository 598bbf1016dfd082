"""Decision scoring: how likely each of N candidate continuations is after one prompt.

A candidate's log-probability is the sum, over its tokens, of the log-probability the
model gives that token after the prompt and the candidate's earlier tokens. The prompt is
prefilled once: the logits of its last token score every candidate's first token, and
the keys and values it leaves in the cache are the prefix every candidate continues
from. Candidates of more than one token then feed their own tokens (all but the last)
on a copy of that prefix (``copy_prompt_cache``), so no candidate sees another's tokens:

* where the family batches (``batch.batchable``: plain KV caches, plain RoPE), up to
  ``ROWS`` candidates run as one batch of rows, right-padded to the longest; padding
  sits after each row's own tokens, so the causal mask alone keeps it out of the scores;
* elsewhere (sliding windows, recurrent layers, multimodal RoPE) one candidate at a time,
  each on a fresh copy of the prompt's cache.

``softmax`` turns the candidates' log-probabilities into the distribution over them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.decode.prefill import PromptInputs, prefill_head
from engine.errors import EngineError
from engine.models.kv_cache import copy_prompt_cache, make_prompt_cache

# Candidates scored together at most: each row holds its own copy of the prompt's KV.
ROWS = 8
PREFILL_CHUNK = 512


class ScoringCancelled(EngineError):
    """The decision request was cancelled before every candidate was scored."""


def check_candidates(
    prompt_ids: Sequence[int], candidates: Sequence[Sequence[int]], vocab_size: int, context_length: int
) -> None:
    """One clear line for what cannot be scored, before any work is done."""
    if not prompt_ids:
        raise EngineError("The prompt is empty: give at least one token to score candidates after.")
    if not candidates:
        raise EngineError("No candidates to score: give at least one (--candidate TEXT or --candidate-ids).")
    for n, ids in enumerate(candidates, 1):
        if not ids:
            raise EngineError(f"Candidate {n} is empty (no tokens beyond the prompt); give it some text or ids.")
    if vocab_size:
        for label, ids in [("The prompt", prompt_ids)] + [(f"Candidate {n}", c) for n, c in enumerate(candidates, 1)]:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise EngineError(f"{label} has token id {bad[0]}, outside the model's vocabulary of {vocab_size}.")
    if context_length:
        for n, ids in enumerate(candidates, 1):
            if len(prompt_ids) + len(ids) > context_length:
                raise EngineError(
                    f"Candidate {n} ({len(ids)} tokens) after the prompt ({len(prompt_ids)} tokens) is longer "
                    f"than the model's context of {context_length} tokens; shorten the prompt or the candidate."
                )


def softmax(logprobs: Sequence[float]) -> list[float]:
    """The candidates' probabilities among themselves (a stable softmax in float64)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill_prompt(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    inputs: PromptInputs | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[Any], mx.array]:
    """(the cache holding the whole prompt, log-probabilities after its last token)."""
    cache = make_prompt_cache(model)
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    n = len(prompt_ids)
    if n > 1 and not prefill_head(model, prompt, cache, chunk=PREFILL_CHUNK, cancel=cancel, inputs=inputs):
        raise ScoringCancelled("The decision request was cancelled.")
    kwargs = inputs.kwargs(n - 1, n) if inputs is not None else {}
    logits = model(prompt[None, n - 1 :], cache=cache, **kwargs)[0, -1]
    first = _log_softmax(logits)
    mx.eval(first, [c.state for c in cache])
    return cache, first


def _rows_scores(
    model: Any,
    prefix: list[Any],
    rows: Sequence[Sequence[int]],
    inputs: PromptInputs | None,
) -> list[float]:
    """Sum of log-probabilities of tokens 2.. of each row (each at least 2 long), the rows
    fed together on copies of ``prefix``."""
    width = max(len(r) for r in rows) - 1
    fed = mx.array([list(r[:-1]) + [0] * (width - len(r) + 1) for r in rows], dtype=mx.uint32)
    targets = mx.array([list(r[1:]) + [0] * (width - len(r) + 1) for r in rows], dtype=mx.uint32)
    keep = mx.array([[1.0] * (len(r) - 1) + [0.0] * (width - len(r) + 1) for r in rows])
    cache = copy_prompt_cache(prefix, len(rows))
    kwargs: dict[str, Any] = {}
    if inputs is not None and inputs.positions is not None:  # multimodal RoPE: text positions continue
        start = int(prefix[0].offset) + inputs.position_delta
        steps = mx.arange(start, start + width, dtype=mx.int32)
        kwargs["position_ids"] = mx.broadcast_to(steps[None, None, :], (3, len(rows), width))
    logprobs = _log_softmax(model(fed, cache=cache, **kwargs))
    picked = mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    sums = (picked * keep).sum(axis=-1)
    mx.eval(sums)
    return [float(x) for x in sums.tolist()]


def score_candidates(
    model: Any,
    prompt_ids: Sequence[int],
    candidates: Sequence[Sequence[int]],
    *,
    inputs: PromptInputs | None = None,
    batched: bool = False,
    cancel: threading.Event | None = None,
) -> list[float]:
    """Each candidate's log-probability after ``prompt_ids`` (``inputs``: what a media
    prompt adds to its ids). ``batched`` feeds up to ROWS candidates together; leave it
    False for families whose caches or positions cannot take rows (``batch.batchable``)."""
    prefix, first = prefill_prompt(model, prompt_ids, inputs=inputs, cancel=cancel)
    scores = [float(first[c[0]].item()) for c in candidates]
    longer = [i for i, c in enumerate(candidates) if len(c) > 1]
    group = ROWS if batched else 1
    for start in range(0, len(longer), group):
        if cancel is not None and cancel.is_set():
            raise ScoringCancelled("The decision request was cancelled.")
        chosen = longer[start : start + group]
        for i, rest in zip(chosen, _rows_scores(model, prefix, [candidates[i] for i in chosen], inputs)):
            scores[i] += rest
    return scores
