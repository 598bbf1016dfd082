"""The history's writer thread: the one place that writes ``history.sqlite3``.

``app.store`` changes its in-memory state at once and queues each write here; this thread
commits them on its own connection in the order they were made, each its own transaction,
so the GUI thread never waits on the disk. A failed write rolls back whole and comes back
as a ``StoreError`` that says what to do.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any


class StoreError(Exception):
    """A write the history could not take (full disk, read-only or failing drive); the
    transaction was rolled back, so what was saved before is intact."""


def _write_failure(exc: sqlite3.Error) -> StoreError:
    text = str(exc).lower()
    if "full" in text:
        why = "the disk is full. Free some space"
    elif "readonly" in text or "read-only" in text:
        why = "the data folder is read-only. Make it writable"
    else:
        why = f"the drive reported an error ({exc}). Check the disk"
    return StoreError(f"Could not save to the chat history: {why}; nothing saved before is lost.")


Statement = tuple[str, tuple]


class Writer:
    """The one thread that writes the history, on its own connection: queued work runs in
    the order it came, and each Future says how it went."""

    def __init__(self, path: Path, failed: Callable[[StoreError], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failed = failed
        self._open = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(path,), daemon=True, name="mlx-desk-history")
        self._thread.start()
        self._open.wait()
        if self._error is not None:
            raise self._error

    def write(self, statements: list[Statement]) -> Future:
        """Run ``statements`` as one transaction; a failure rolls them all back (StoreError)."""
        return self.call(lambda db: transaction(db, statements))

    def call(self, work: Callable[[sqlite3.Connection], Any]) -> Future:
        done: Future = Future()
        if self._closed:  # a late write (a window closing after its store): said, never hung on
            done.set_exception(StoreError("Could not save to the chat history: it is closed."))
        else:
            self._jobs.put((work, done))
        return done

    def flush(self) -> None:
        """Wait until everything queued so far has run."""
        self.call(lambda _db: None).result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._thread.join()

    def _run(self, path: Path) -> None:
        try:
            db = sqlite3.connect(path, isolation_level=None)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
        except BaseException as exc:  # noqa: BLE001 - raised on the opening thread
            self._error = exc
            self._open.set()
            return
        self._open.set()
        while (job := self._jobs.get()) is not None:
            work, done = job
            try:
                done.set_result(work(db))
            except StoreError as exc:
                done.set_exception(exc)
                self._failed(exc)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                done.set_exception(exc)
        db.close()


def transaction(db: sqlite3.Connection, statements: list[Statement]) -> None:
    """BEGIN ... COMMIT, or ROLLBACK and a StoreError when the write cannot land."""
    try:
        with db:
            db.execute("BEGIN")
            for sql, args in statements:
                db.execute(sql, args)
    except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
        raise _write_failure(exc) from exc
