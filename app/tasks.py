"""Fire-and-forget coroutines from Qt slots, with failures reported, never lost; and the
count of background work still under way (tasks and app.ops Ops), which tests wait on."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

_running: set[object] = set()  # spawned tasks, and app.ops work not yet settled on the GUI thread
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
    assert exc is not None
    report(exc)


def report(exc: BaseException) -> None:
    """An unexpected failure of background work: the log, and the status bar when set."""
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    if _reporter is not None:
        _reporter(f"Something went wrong: {exc}")


def hold(work: object) -> None:
    """Count ``work`` (an app.ops Op under way) as pending until ``release``."""
    _running.add(work)


def release(work: object) -> None:
    _running.discard(work)


def pending() -> int:
    """Background work not finished yet: spawned tasks and Ops whose callbacks have not run."""
    return len(_running)
