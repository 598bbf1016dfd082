"""``POST /v1/decide``: the probability of each candidate answer after a prompt.

Request body (JSON):

    {"model": "...",
     "prompt": "text" | [ids]          (or "messages": [...] as in /v1/chat/completions,
                                         images as image_url data: URLs, audio as input_audio),
     "candidates": ["yes", "no"] | [[1, 2], [3]]}

Reply: ``{"object": "decision", "model", "candidates", "logprobs", "probabilities",
"candidate_ids", "usage": {"prompt_tokens"}}``. ``logprobs`` are each candidate's
log-probability given the prompt (the sum over its tokens), ``probabilities`` the
softmax over the candidates. Bad input (no candidates, an empty one, ids past the
vocabulary, a candidate longer than the context) answers 400 with one line.

Admission: decisions have a pool of their own beside generation. At most
``MAX_DECISIONS`` wait or run at once per server; more answer 429 at once, so a burst of
scoring requests never queues behind (or ahead of) chats without bound. In the worker a
decision runs between the generation batch's steps, on caches of its own.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from engine.api import Decide
from engine.serve.common import check_body, check_model, field, run
from engine.serve.http import ApiError, Handler

MAX_DECISIONS = 4
MAX_CANDIDATES = 256

_slots: weakref.WeakKeyDictionary[Any, threading.BoundedSemaphore] = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def _pool(server: Any) -> threading.BoundedSemaphore:
    with _slots_lock:
        pool = _slots.get(server)
        if pool is None:
            pool = _slots[server] = threading.BoundedSemaphore(MAX_DECISIONS)
        return pool


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _candidates(raw: Any) -> list[str] | list[list[int]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(
            400, "'candidates' must be a non-empty list of strings or of token-id lists.", param="candidates"
        )
    if len(raw) > MAX_CANDIDATES:
        raise ApiError(400, f"'candidates' holds {len(raw)} items; at most {MAX_CANDIDATES}.", param="candidates")
    if all(isinstance(c, str) for c in raw) or all(_is_ids(c) for c in raw):
        return raw
    raise ApiError(400, "'candidates' must be all strings or all lists of token ids.", param="candidates")


def _request(body: dict[str, Any], backend: Any) -> Decide:
    candidates = _candidates(body.get("candidates"))
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ApiError(400, "Give either 'prompt' (text or token ids) or 'messages', not both.", param="prompt")
    if messages is not None:
        from engine.serve.openai_api import chat_messages

        return Decide(candidates=candidates, messages=chat_messages(messages, backend.tool_format))
    if not (isinstance(prompt, str) or _is_ids(prompt)):
        raise ApiError(400, "'prompt' must be a string or a list of token ids.", param="prompt")
    if isinstance(prompt, str) != isinstance(candidates[0], str):
        raise ApiError(
            400,
            "Text candidates go with a text prompt, token-id candidates with a token-id prompt.",
            param="candidates",
        )
    return Decide(candidates=candidates, prompt=prompt)


def decide(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    field(body, "candidates", list, required=True)
    request = _request(body, backend)
    pool = _pool(handler.server)
    if not pool.acquire(blocking=False):
        raise ApiError(
            429,
            f"{MAX_DECISIONS} decision requests are already waiting or running; retry in a moment.",
            "rate_limit_error",
        )
    try:
        result = run(handler, request, lambda event: None)
    finally:
        pool.release()
    handler.send_json(
        200,
        {
            "object": "decision",
            "model": model,
            "candidates": result.candidates,
            "logprobs": result.logprobs,
            "probabilities": result.probabilities,
            "candidate_ids": result.candidate_ids,
            "usage": {"prompt_tokens": result.prompt_tokens},
        },
    )
