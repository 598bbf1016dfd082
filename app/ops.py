"""``Op``: the one way the app runs slow work off the GUI thread.

Slow work that is not the engine's (copying and hashing attachments, decoding thumbnails,
scanning folders, Hub searches and downloads) is an ``Op``, after the pattern of Anki's
CollectionOp/QueryOp: the work runs on a helper thread, and what follows runs on the GUI
thread. Two ways to use one:

    hits = await Op(hub.search_hub, query, 50)           # in a coroutine: the value, or its exception

    Op(thumbnail_image, path, size).success(self.set_thumbnail).run(owner=self)   # from a slot

- The work runs on a small pool of daemon threads (at most ``MAX_THREADS`` at once; more
  wait their turn, an idle thread is reused), so quitting never waits on a hung download.
- ``success``, ``failure`` and ``with_progress`` callbacks run on the GUI thread, through
  Qt's queued signals (they need no asyncio loop, so an Op may start while the window is
  still being built), and not at all once ``owner`` (the widget that asked) is deleted.
- ``with_progress(fn)`` hands the work a ``progress`` keyword: a callable that is safe to
  call from the work's thread; each call reaches ``fn`` on the GUI thread.
- A failure with no ``failure`` callback is reported like any failed task (app.tasks: the
  status bar and the log), never lost.

Work another thread already owns is watched, not run: ``Op.of_future(future)`` waits for
a ``concurrent.futures.Future`` (the history writer's, whose writes keep their order on its
own thread) with the same callbacks and the same ``await``.

The engine is not reached through an Op: EngineBridge's futures are the door to the one
thread that touches MLX.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from app import tasks
from app.qt import QObject, Qt, Signal, isValid

T = TypeVar("T")
U = TypeVar("U")

MAX_THREADS = 8  # helper threads at once; a long download holds one, thumbnails share the rest
IDLE_S = 30.0  # an idle helper thread ends after this long


class _Pool:
    """Daemon threads taking work from one queue; a thread starts only when the queue holds
    more work than there are idle threads, and ends after ``IDLE_S`` without work."""

    def __init__(self, limit: int):
        self._limit = limit
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._names = itertools.count(1)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queue.put(job)
            start = self._queue.qsize() > self._idle and self._threads < self._limit
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, daemon=True, name=f"mlx-desk-op-{next(self._names)}").start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._queue.empty():  # submit checks under the lock: nothing is stranded
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
            job()


_pool = _Pool(MAX_THREADS)


class _Relay(QObject):
    """Carries a helper thread's news to the GUI thread (a queued connection)."""

    news = Signal(object)  # a zero-argument callable, run on the GUI thread

    def __init__(self) -> None:
        super().__init__()
        self.news.connect(self._run, Qt.ConnectionType.QueuedConnection)

    def _run(self, call: Callable[[], None]) -> None:
        call()


_relay: _Relay | None = None


def _to_gui(call: Callable[[], None]) -> None:
    """Run ``call`` on the GUI thread (from any thread); nothing when the app has gone."""
    relay = _relay
    if relay is None:
        return
    try:
        relay.news.emit(call)
    except RuntimeError:  # the relay was deleted with the application
        pass


def _alive(owner: QObject | None) -> bool:
    return owner is None or isValid(owner)


class Op(Generic[T]):
    """Slow non-engine work: run it with ``run(owner)`` (callbacks) or ``await`` it (value)."""

    def __init__(self, work: Callable[..., T], *args: Any, **kwargs: Any):
        self._work: Callable[..., T] | None = functools.partial(work, *args, **kwargs)
        self._watched: concurrent.futures.Future[T] | None = None
        self._on_success: Callable[[T], None] | None = None
        self._on_failure: Callable[[Exception], None] | None = None
        self._on_progress: Callable[..., None] | None = None
        self._owner: QObject | None = None
        self._future: concurrent.futures.Future[T] | None = None

    @classmethod
    def of_future(cls, future: concurrent.futures.Future[U] | None) -> Op[U | None]:
        """Watch work another thread runs; ``None`` (nothing was queued) is done at once."""
        op: Op[U | None] = Op(lambda: None)
        op._work = None
        watched: concurrent.futures.Future[Any] = future if future is not None else concurrent.futures.Future()
        if future is None:
            watched.set_result(None)
        op._watched = watched
        return op

    def success(self, fn: Callable[[T], None]) -> Op[T]:
        """``fn(value)`` on the GUI thread when the work returns."""
        self._on_success = fn
        return self

    def failure(self, fn: Callable[[Exception], None]) -> Op[T]:
        """``fn(exc)`` on the GUI thread when the work raises (instead of the status bar)."""
        self._on_failure = fn
        return self

    def with_progress(self, fn: Callable[..., None]) -> Op[T]:
        """Hand the work ``progress=...``; each call of it becomes ``fn(*values)`` on the GUI thread."""
        self._on_progress = fn
        return self

    def run(self, owner: QObject | None = None) -> concurrent.futures.Future[T]:
        """Start the work; ``success`` or ``failure`` follows on the GUI thread unless ``owner``
        has been deleted by then. Returns the work's future (most callers drop it)."""
        self._owner = owner
        future = self._start()
        tasks.hold(self)
        future.add_done_callback(lambda done: _to_gui(lambda: self._settle(done)))
        return future

    def __await__(self) -> Generator[Any, None, T]:
        """The work's value (or its exception), awaited on the GUI thread's event loop."""
        return asyncio.wrap_future(self._start()).__await__()

    # ---- plumbing -------------------------------------------------------------------------

    def _start(self) -> concurrent.futures.Future[T]:
        global _relay
        if self._future is not None:
            return self._future  # started already: awaiting twice waits for the same work
        if _relay is None:
            _relay = _Relay()  # made on the GUI thread, where Ops start
        if self._watched is not None:
            self._future = self._watched
            return self._future
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        work = self._work
        assert work is not None
        if self._on_progress is not None:
            work = functools.partial(work, progress=self._progress)
        self._future = future

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                value = work()
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                future.set_exception(exc)
            else:
                future.set_result(value)

        _pool.submit(job)
        return future

    def _progress(self, *values: Any) -> None:
        """Called on the work's thread."""
        _to_gui(lambda: self._show_progress(values))

    def _show_progress(self, values: tuple[Any, ...]) -> None:
        if self._on_progress is not None and _alive(self._owner):
            self._on_progress(*values)

    def _settle(self, done: concurrent.futures.Future[T]) -> None:
        """On the GUI thread: the callback the outcome asks for; a callback that raises is
        reported as a failed task is."""
        try:
            if not _alive(self._owner) or done.cancelled():
                return
            exc = done.exception()
            if exc is None:
                if self._on_success is not None:
                    self._on_success(done.result())
            elif self._on_failure is not None and isinstance(exc, Exception):
                self._on_failure(exc)
            else:
                tasks.report(exc)
        except Exception as exc:  # noqa: BLE001 - a callback's bug reaches the status bar
            tasks.report(exc)
        finally:
            tasks.release(self)
