"""Byte counts as people read them, and the machine's memory: plain Python, no Qt."""

from __future__ import annotations

import os

GB = 1024**3


def fmt_bytes(n: float) -> str:
    if n >= GB:
        return f"{n / GB:.1f} GB"
    if n >= 1024**2:
        return f"{n / 1024**2:.0f} MB"
    return f"{n / 1024:.0f} KB"


def experts_note(plan: object) -> str:
    """A sentence on an MoE model's experts read from disk ("" when all are held)."""
    experts = getattr(plan, "experts", None)
    if experts is None or not experts.streamed:
        return ""
    return (
        f"It runs with experts from disk: {fmt_bytes(experts.slab_bytes)} of its "
        f"{fmt_bytes(experts.total_bytes)} of experts held, {fmt_bytes(experts.streamed_bytes)} read when "
        f"routed (about {experts.speed_share:.0%} of full speed)."
    )


def machine_memory() -> int:
    """Physical memory, known before the engine starts (0 where the OS will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
