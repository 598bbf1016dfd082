"""The built-in MTP layer, set apart at load, read when a request first drafts with it.

It then stays, counted in the weights, and the plan is made again with it: chats may grow
only as far as the KV cache still fits, and the media features cache shrinks to the room
left; a layer the budget cannot hold is refused. The read is the request's "load"
progress, and adapters mounted before it take their targets inside it. A request stopped
during the read (checked between chunks) leaves the layer apart and unread, the plan and
the limits as they were, and goes on without drafting, to end as any request stopped
before its prefill does ("cancelled", nothing generated).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.api import GenerationParams
from engine.errors import OutOfMemoryBudget

ProgressFor = Callable[[str], Callable[[int, int], None] | None]  # a message -> the read's progress sink


def attach_mtp(
    state: Any,
    params: GenerationParams,
    weights_bytes: Callable[[], int],
    progress_for: ProgressFor,
    cancel: threading.Event | None = None,
) -> GenerationParams:
    """Read ``state``'s MTP layer for a request that drafts with it (``state``: the host's
    loaded model; ``weights_bytes()`` what its weights hold now) and re-plan; returns the
    params the request runs with."""
    if params is None or params.speculative != "mtp" or state.mtp_apart is None:
        return params  # no params: the session's defaults, which never draft
    from engine.models import lora
    from engine.runtime.loading import attach_mtp_apart
    from engine.runtime.memory import format_bytes

    info, apart = state.info, state.mtp_apart
    plan, advice = _replanned(info, apart.nbytes, weights_bytes)
    reading = f"Reading the built-in MTP layer ({format_bytes(apart.nbytes)})…"
    if not attach_mtp_apart(state.model, apart, progress_for(reading), cancel):
        return replace(params, speculative=None)  # stopped: the plan and the limits stay as they were
    state.mtp_apart = None
    lora.mount_waiting(state.model)
    if plan is not None:
        state.info = replace(info, plan=plan, context_advice=advice or info.context_advice)
        state.towers.follow_plan(plan)
    if advice is not None and advice.limit:
        for chat in state.sessions.values():
            chat.context_length = min(chat.context_length or advice.limit, advice.limit)
    return params


def _replanned(info: Any, layer_bytes: int, weights_bytes: Callable[[], int]) -> tuple[Any, Any]:
    """(the memory plan with the layer counted in the weights, the context advice under it);
    (None, None) without a plan. Refused when the budget cannot hold the layer."""
    from engine.runtime.context_planner import after_more_weights
    from engine.runtime.memory import format_bytes

    if info.plan is None:
        return None, None
    weights = weights_bytes()
    if weights + layer_bytes >= info.plan.budget_bytes:
        raise OutOfMemoryBudget(
            f"The built-in MTP layer ({format_bytes(layer_bytes)}) does not fit beside the weights "
            f"({format_bytes(weights)}) in the memory budget "
            f"({format_bytes(info.plan.budget_bytes)}); draft with n-grams instead, or raise the memory budget."
        )
    plan = replace(info.plan, weights_bytes=info.plan.weights_bytes + layer_bytes, mtp_loaded=True)
    advice = None
    if info.context_advice is not None:
        try:
            advice = after_more_weights(info.context_advice, plan, info.name)
        except OutOfMemoryBudget as e:
            raise OutOfMemoryBudget(f"With its built-in MTP layer ({format_bytes(layer_bytes)}): {e}") from None
    return plan, advice
