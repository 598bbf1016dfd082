"""Helpers for soak tests: the process's resident memory, and trends against turns.

A soak asserts that a figure does not grow with the turns: a least-squares slope, not a
threshold on the figure itself, so a slow machine does not fail it and a leak does."""

from __future__ import annotations

import os

HAS_RSS = os.path.exists("/proc/self/statm")


def rss_bytes() -> int:
    """Resident memory of this process (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n = len(ys)
    mx_, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx_) * (y - my) for i, y in enumerate(ys)) / sum((i - mx_) ** 2 for i in range(n))


def block_medians(ys: list[float], block: int) -> list[float]:
    """The median of each run of ``block`` values: a trend that one slow moment (another
    process taking the CPU) cannot tilt."""
    out = []
    for start in range(0, len(ys) - block + 1, block):
        run = sorted(ys[start : start + block])
        out.append(run[len(run) // 2])
    return out
