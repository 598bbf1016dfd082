"""What a chat does when it outgrows the model's context, as LM Studio names the choices:

* ``stop``: nothing is dropped; the reply is capped at what still fits and ends with
  finish reason "length" (a prompt that does not fit at all is the engine's to refuse).
* ``truncate_middle``: keep the system prompt and the first exchange, drop the oldest
  turns after it until the prompt fits with room for the reply.
* ``rolling``: keep the system prompt, drop the oldest turns.

Dropping works on whole messages and keeps the kept part starting with a user turn, since
many chat templates insist that user and assistant alternate. The latest turn is always
kept: when even that does not fit, what is left goes to the engine's own refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

POLICIES = ("stop", "truncate_middle", "rolling")


def reply_room(limit: int, max_tokens: int) -> int:
    """Tokens kept free for the reply when dropping turns: what it asks, up to a quarter of
    the context (a long max_tokens must not empty the chat)."""
    return max(1, min(max_tokens, limit // 4))


def fit_messages(
    messages: Sequence[Mapping[str, Any]],
    count_tokens: Callable[[list[Mapping[str, Any]]], int],
    limit: int,
    room: int,
    policy: str | None,
) -> tuple[list[Mapping[str, Any]], int]:
    """(messages that fit in ``limit - room`` tokens under ``policy``, how many were dropped)."""
    messages = list(messages)
    if policy not in ("truncate_middle", "rolling") or limit <= 0:
        return messages, 0
    budget = limit - room
    if count_tokens(messages) <= budget:
        return messages, 0
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    if policy == "truncate_middle":
        # The first exchange: the first user turn and the reply to it.
        if head < len(messages) - 1 and messages[head].get("role") == "user":
            head += 1
            if head < len(messages) - 1 and messages[head].get("role") == "assistant":
                head += 1
    kept, body = messages[:head], messages[head:]
    dropped = 0
    while len(body) > 1 and count_tokens(kept + body) > budget:
        body.pop(0)
        dropped += 1
        while len(body) > 1 and body[0].get("role") != "user":
            body.pop(0)
            dropped += 1
    return kept + body, dropped
