"""Opening the history when it cannot simply be opened: damaged, read-only, unreachable.

A damaged or read-only history never means no window. ``open_history`` tries the data
folder; when that fails it says what happened in a dialog and offers what fits:

- start a fresh history (the old file stays beside it, renamed with the date and time),
- salvage what can still be read into a new history (the old file is kept the same way),
- choose another folder,
- quit.

The checks run before the window exists: ``PRAGMA quick_check`` finds damaged pages
(an index page included) that would otherwise fail later, in the middle of the UI.
Salvage copies table by table, row by row where a whole-table read fails, skipping
only the rows that cannot be read. No Qt here except in ``HistoryDialog``.
"""

from __future__ import annotations

import errno
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.history_schema import NewerHistory
from app.store import DB_NAME, HistoryStore

TABLES = ("conversations", "messages", "attachments", "preferences")


@dataclass
class HistoryProblem:
    kind: str  # "damaged" | "newer" | "read-only" | "unreachable"
    data_dir: Path
    detail: str

    @property
    def message(self) -> str:
        where = self.data_dir / DB_NAME
        if self.kind == "damaged":
            return (
                f"The chat history in {where} is damaged ({self.detail}). You can start a fresh "
                "history (the damaged file is kept beside it, renamed with today's date), salvage "
                "what can still be read into a new one, or choose another folder."
            )
        if self.kind == "newer":
            return (
                f"The chat history in {where} was written by a newer version of MLX Desk ({self.detail}). "
                "Open it with that version, or start a fresh history here (the file is kept beside it, "
                "renamed with today's date) or salvage what this version can read into a new one."
            )
        if self.kind == "read-only":
            return (
                f"The data folder {self.data_dir} is read-only, so chats cannot be saved there "
                f"({self.detail}). Make it writable and try again, or choose another folder."
            )
        return (
            f"The chat history in {where} cannot be opened ({self.detail}). "
            "Choose another folder, or quit and check the disk."
        )


def _classify(exc: BaseException, data_dir: Path) -> HistoryProblem:
    text = " ".join(str(exc).split()) or "no details"
    low = text.lower()
    if isinstance(exc, NewerHistory):
        return HistoryProblem("newer", data_dir, text)
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return HistoryProblem("read-only", data_dir, text)
    if "readonly" in low or "read-only" in low or "read only" in low:
        return HistoryProblem("read-only", data_dir, text)
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return HistoryProblem("damaged", data_dir, text)
    if any(w in low for w in ("malformed", "not a database", "corrupt", "disk image")):
        return HistoryProblem("damaged", data_dir, text)
    return HistoryProblem("unreachable", data_dir, text)


def try_open(data_dir: Path) -> HistoryStore | HistoryProblem:
    """The store, or what is wrong with the folder."""
    store = None
    try:
        store = HistoryStore(data_dir)
        bad = [r[0] for r in store._db.execute("PRAGMA quick_check(5)")]
        if bad != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(bad)[:200])
        store.list_conversations()
        return store
    except (sqlite3.Error, OSError) as exc:
        if store is not None:
            store.close()
        return _classify(exc, data_dir)
    except Exception as exc:  # noqa: BLE001 - a StoreError or anything else: say it, offer a way out
        if store is not None:
            store.close()
        return _classify(exc, data_dir)


def _stamp() -> str:
    return time.strftime("%Y-%m-%d-%H%M%S")


def set_aside(data_dir: Path, why: str = "damaged") -> Path:
    """Rename the history (and its WAL files) to history-<why>-<date>.sqlite3; returns it."""
    db = data_dir / DB_NAME
    kept = data_dir / f"{db.stem}-{why}-{_stamp()}{db.suffix}"
    for suffix in ("", "-wal", "-shm"):
        part = Path(str(db) + suffix)
        if part.exists():
            part.rename(Path(str(kept) + suffix))
    return kept


def _readable_rows(old: sqlite3.Connection, table: str) -> list[tuple]:
    try:
        return old.execute(f"SELECT * FROM {table} NOT INDEXED ORDER BY rowid").fetchall()
    except sqlite3.Error:
        pass
    rows = []
    try:
        top = old.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0] or 0
    except sqlite3.Error:
        top = 100_000
    for rowid in range(1, top + 1):
        try:
            row = old.execute(f"SELECT * FROM {table} WHERE rowid=?", (rowid,)).fetchone()
        except sqlite3.Error:
            continue
        if row is not None:
            rows.append(row)
    return rows


def salvage(data_dir: Path, why: str = "damaged") -> tuple[Path, dict[str, int]]:
    """Copy what can be read into a new history; the old one is set aside. Returns the
    kept file and how many rows of each table came across."""
    kept = set_aside(data_dir, why)
    counts: dict[str, int] = {}
    old = sqlite3.connect(f"file:{kept}?mode=ro", uri=True)
    try:
        new = HistoryStore(data_dir)
        db = new._db
        db.execute("PRAGMA foreign_keys=OFF")  # parents may be among the lost rows
        for table in TABLES:
            try:
                columns = [r[1] for r in old.execute(f"PRAGMA table_info({table})")]
                rows = _readable_rows(old, table) if columns else []
            except sqlite3.Error:
                columns, rows = [], []
            wanted = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
            keep = [i for i, c in enumerate(columns) if c in wanted]
            names = ", ".join(columns[i] for i in keep)
            marks = ", ".join("?" for _ in keep)
            copied = 0
            for row in rows:
                try:
                    db.execute(f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({marks})", tuple(row[i] for i in keep))
                    copied += 1
                except sqlite3.Error:
                    continue
            counts[table] = copied
        db.execute("PRAGMA foreign_keys=ON")
        new.close()
    finally:
        old.close()
    return kept, counts


# What the person chose: ("fresh" | "salvage" | "folder" | "retry" | "quit", a folder or None)
Choice = tuple[str, Path | None]


def open_history(
    data_dir: Path, ask: Callable[[HistoryProblem], Choice], notes: list[str] | None = None
) -> HistoryStore | None:
    """Open the history in ``data_dir``, asking what to do while it cannot be opened. None
    when the person chose to quit. ``ask`` puts the problem to the person (the window's
    dialog: app.ui.history_dialog.ask_with_dialog). ``notes`` collects lines for the status bar."""
    notes = notes if notes is not None else []
    while True:
        opened = try_open(data_dir)
        if not isinstance(opened, HistoryProblem):
            return opened
        action, folder = ask(opened)
        if action == "quit":
            return None
        if action == "folder" and folder is not None:
            data_dir = Path(folder)
        elif action == "fresh":
            kept = set_aside(data_dir, opened.kind)
            notes.append(f"Started a fresh history; the {opened.kind} one is kept as {kept.name}.")
        elif action == "salvage":
            kept, counts = salvage(data_dir, opened.kind)
            notes.append(
                f"Salvaged {counts.get('conversations', 0)} chats and {counts.get('messages', 0)} "
                f"messages; the {opened.kind} history is kept as {kept.name}."
            )
