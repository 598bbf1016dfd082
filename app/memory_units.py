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


def machine_memory() -> int:
    """Physical memory, known before the engine starts (0 where the OS will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
