"""The log-probability of each token of a prompt given the tokens before it, in one pass
over the prompt (chunked, on a fresh cache): what ``echo`` with ``logprobs`` reports and
lm-eval's loglikelihood sums. The numbers are those decoding reports for the same token
at the same position (float32 log-softmax of the same logits)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.errors import EngineError
from engine.models.kv_cache import make_prompt_cache

SCORE_CHUNK = 256  # positions per pass: bounds the (chunk, vocab) float32 logits held at once


def score_tokens(
    model: Any,
    ids: Sequence[int],
    *,
    top_logprobs: int = 0,
    chunk: int = SCORE_CHUNK,
    cancel: threading.Event | None = None,
) -> tuple[list[float | None], list[list[tuple[int, float]]] | None]:
    """(per token: its log-probability, None for the first), and with ``top_logprobs``
    per token the most likely (id, logprob) pairs, best first (the first token's empty)."""
    cache = make_prompt_cache(model)
    tokens = mx.array(list(ids), dtype=mx.int32)
    logprobs: list[float | None] = [None]
    tops: list[list[tuple[int, float]]] | None = [[]] if top_logprobs > 0 else None
    total = len(ids)
    for start in range(0, total - 1, chunk):
        if cancel is not None and cancel.is_set():
            raise EngineError("The scoring request was cancelled.")
        end = min(start + chunk, total - 1)  # logits at positions start..end-1 predict tokens start+1..end
        raw = model(tokens[None, start:end], cache=cache)[0].astype(mx.float32)
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[start + 1 : end + 1, None], axis=-1)[:, 0]
        if tops is not None:
            k = min(top_logprobs, lp.shape[-1])
            best = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            values = mx.take_along_axis(lp, best, axis=-1)
            order = mx.argsort(-values, axis=-1)  # best first, as clients expect
            best, values = mx.take_along_axis(best, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
            mx.eval(chosen, best, values)
            tops.extend(
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(best.tolist(), values.tolist(), strict=True)
            )
        else:
            mx.eval(chosen)
        logprobs.extend(chosen.tolist())
    return logprobs, tops
