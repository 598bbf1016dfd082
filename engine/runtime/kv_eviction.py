"""Chats out of view give their KV caches back when memory runs short.

Every chat keeps its KV cache so a follow-up turn only prefills its new tokens, but 30
chats of 1,000 tokens held 296 MB until the model unloaded, past any budget. The host's
sessions are kept in use order (``touch`` moves one to the end); before a request, the
caches of the least recently used other chats are dropped until all caches fit in what
the budget leaves beside the weights. A dropped chat is rebuilt from its messages (a
full prefill) when it is next used: slower, never different.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any


def session_kv_bytes(chat: Any) -> int:
    """What one chat's caches (its own and its draft model's) hold."""
    caches = [*(getattr(chat, "cache", None) or ()), *(getattr(chat, "draft_cache", None) or ())]
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)


def touch(sessions: MutableMapping[str, Any], session_id: str) -> None:
    """Mark ``session_id`` as the most recently used (the mapping keeps use order)."""
    if session_id in sessions:
        sessions[session_id] = sessions.pop(session_id)


def evict_idle_caches(sessions: MutableMapping[str, Any], keep: str, allowance: int | None) -> list[str]:
    """Reset the caches of the least recently used chats other than ``keep`` until the
    caches of all chats hold at most ``allowance`` bytes. Returns the chats reset."""
    if allowance is None:
        return []
    sizes = {sid: session_kv_bytes(chat) for sid, chat in sessions.items()}
    total = sum(sizes.values())
    evicted = []
    for sid, chat in list(sessions.items()):  # oldest first
        if total <= allowance:
            break
        if sid == keep or not sizes[sid]:
            continue
        chat.reset()
        total -= sizes[sid]
        evicted.append(sid)
    if evicted:
        import mlx.core as mx

        mx.clear_cache()  # hand the freed buffers back instead of keeping them for reuse
    return evicted


def kv_allowance(info: Any, weights_bytes: int) -> int | None:
    """Bytes the budget leaves for KV caches beside the weights (None without a plan)."""
    plan = getattr(info, "plan", None)
    if plan is None or not getattr(plan, "budget_bytes", 0):
        return None
    return max(0, int(plan.budget_bytes) - int(weights_bytes))
