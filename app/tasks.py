"""Fire-and-forget coroutines from Qt slots, with failures reported, never lost."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

_running: set[asyncio.Future] = set()
_reporter: Callable[[str], None] | None = None


def set_reporter(report: Callable[[str], None] | None) -> None:
    """Where an unexpected exception in a background task is shown (the status bar)."""
    global _reporter
    _reporter = report


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Future:
    task = asyncio.ensure_future(coro)
    _running.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Future) -> None:
    _running.discard(task)
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    if _reporter is not None:
        _reporter(f"Something went wrong: {exc}")


def pending() -> int:
    return len(_running)
