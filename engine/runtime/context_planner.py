"""The context planner: how long a chat may grow in the memory budget, and what to pick.

Today's models publish contexts of 128k-262k tokens, whose KV cache alone is often larger
than the memory left beside the weights. So the chat's hard limit is the least of three:
the model's context, the user's cap, and what the KV cache holds at the loaded precision
within the budget. The recommendation is the highest KV precision that holds the model's
whole context (or the user's cap); when none does, the highest that still holds a useful
chat (``USEFUL_TOKENS``), else the one that holds the most. The planner recommends; it
never changes the KV precision itself, and it never raises or lowers a cap the user set: a
cap the budget cannot hold is refused at load, with what would fit (``check_cap``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from engine.api import UNLIMITED_CONTEXT, ContextAdvice, MemoryPlan, ModelInfo
from engine.errors import OutOfMemoryBudget
from engine.runtime.memory import format_bytes, with_kv_settings

USEFUL_TOKENS = 32_768  # a long chat or a large document: worth full or 8-bit precision over 4-bit
PRECISIONS: tuple[int | None, ...] = (None, 8, 4)  # best first


def usable_tokens(plan: MemoryPlan) -> int:
    """The longest context whose KV cache fits beside the weights in the budget (the budget
    leaves each step's working set out, as the memory eviction does), rounded down to a
    multiple of 256 past 1,024 tokens; ``UNLIMITED_CONTEXT`` when the cache stops growing."""
    tokens = plan.max_context
    if tokens == UNLIMITED_CONTEXT or tokens < 1024:
        return tokens
    return tokens - tokens % 256


def _least(*limits: int) -> int:
    """The least positive limit; 0 when none is set."""
    known = [n for n in limits if 0 < n < UNLIMITED_CONTEXT]
    return min(known) if known else 0


def _precision(bits: int | None) -> str:
    return "full-precision" if bits is None else f"{bits}-bit"


def precision_options(
    base: ModelInfo, config: Any, settings_for: Callable[[int], list | None]
) -> dict[int | None, MemoryPlan]:
    """The memory plan at each KV precision the model's cache can take: ``base`` is the
    full-precision info, ``settings_for(bits)`` each layer's KV setting at ``bits`` (None
    when no layer's cache can be quantized: latent or recurrent caches)."""
    if base.plan is None:
        return {}
    options: dict[int | None, MemoryPlan] = {None: base.plan}
    for bits in (8, 4):
        settings = settings_for(bits)
        if settings:
            plan = with_kv_settings(base, config, settings).plan
            if plan is not None:
                options[bits] = plan
    return options


def advise_context(
    loaded: MemoryPlan,
    options: Mapping[int | None, MemoryPlan],
    model_context: int,
    cap: int | None = None,
) -> ContextAdvice:
    """``loaded``: the plan at the KV precision the model is loaded with; ``options``: the
    plans at each precision the family's cache can take (None: full precision)."""
    limit = _least(model_context, cap or 0, usable_tokens(loaded))
    target = _least(model_context, cap or 0) or UNLIMITED_CONTEXT
    holds = {bits: usable_tokens(options[bits]) for bits in PRECISIONS if bits in options}
    # Best first: the whole target, else a useful chat, else whatever holds the most.
    wanted = [b for b, n in holds.items() if n >= target] or [
        b for b, n in holds.items() if n >= min(target, USEFUL_TOKENS)
    ]
    if wanted:
        bits = wanted[0]
    else:
        bits = max(holds, key=lambda b: holds[b]) if holds else None
    tokens = min(target, holds.get(bits, 0))
    return ContextAdvice(
        limit=limit,
        recommended_tokens=0 if tokens == UNLIMITED_CONTEXT else tokens,
        recommended_kv_bits=bits,
        cap=cap,
        note=_note(bits, tokens, target, holds, cap),
    )


def _note(bits: int | None, tokens: int, target: int, holds: Mapping[int | None, int], cap: int | None) -> str:
    what = "your context cap" if cap else "the model's whole context"
    if target == UNLIMITED_CONTEXT and tokens == UNLIMITED_CONTEXT:
        return "The KV cache stops growing (every layer keeps a window): any context length fits."
    if tokens >= target:
        note = f"{_precision(bits).capitalize()} KV holds {what} ({target:,} tokens) in this budget."
    else:
        note = f"Recommended: {_precision(bits)} KV, up to {tokens:,} tokens"
        if target != UNLIMITED_CONTEXT:
            note += f" ({what} is {target:,})"
        if bits is not None and holds.get(None):
            note += f"; full precision holds {holds[None]:,}"
        note += "."
    return note


def check_cap(cap: int | None, loaded: MemoryPlan, options: Mapping[int | None, MemoryPlan], name: str) -> None:
    """OutOfMemoryBudget when the user's context cap needs more KV cache than the budget
    leaves at the loaded precision, naming what fits and a precision that would hold it."""
    if not cap or usable_tokens(loaded) >= cap:
        return
    need = loaded.kv_bytes(cap)
    fits = usable_tokens(loaded)
    message = (
        f"A {cap:,}-token context on {name} needs {format_bytes(need)} of KV cache beside "
        f"{format_bytes(loaded.weights_bytes)} of weights; the memory budget is {format_bytes(loaded.budget_bytes)}. "
        f"Lower the context length to {fits:,} tokens"
    )
    better = next((b for b in (8, 4) if b in options and usable_tokens(options[b]) >= cap), None)
    if better is not None:
        message += f", or hold the KV cache at {better} bits (the whole cap fits)"
    raise OutOfMemoryBudget(message + ", or raise the memory budget.")


def after_more_weights(advice: ContextAdvice, plan: MemoryPlan, name: str) -> ContextAdvice:
    """``advice`` once more weights joined the loaded model (``plan``, weights included: a
    built-in MTP layer read for drafting): its limit lowered to what the KV cache still
    holds; OutOfMemoryBudget, before anything is read, when the user's cap no longer fits."""
    check_cap(advice.cap, plan, {}, name)
    return replace(advice, limit=_least(advice.limit, usable_tokens(plan)))
