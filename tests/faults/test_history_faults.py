"""A damaged, read-only or unreachable history never means no window: a real dialog says
what happened and offers a fresh history, salvage, or another folder."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from app import history_recovery
from app.history_recovery import open_history, try_open
from app.qt import QApplication, QFileDialog, QTimer
from app.store import DB_NAME, HistoryStore
from app.ui.history_dialog import ask_with_dialog

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _history(folder: Path, chats: int = 3, messages: int = 40) -> None:
    store = HistoryStore(folder)
    for c in range(chats):
        conv = store.create_conversation(f"chat {c}")
        parent = None
        for m in range(messages):
            parent = store.add_message(
                conv, "user" if m % 2 == 0 else "assistant", f"message {m} of chat {c} " + "x" * 200, parent
            )
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()


def _page_size(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("PRAGMA page_size").fetchone()[0]


def _damage_page(db: Path, name: str) -> None:
    """Overwrite the root page of table or index ``name`` with garbage."""
    with sqlite3.connect(db) as c:
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (name,)).fetchone()[0]
    size = _page_size(db)
    with db.open("r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xa5" * size)


DAMAGE = {
    "garbage file": lambda db: db.write_bytes(b"this is not a database" * 100),
    "truncated header": lambda db: db.write_bytes(db.read_bytes()[:50]),
    "index page": lambda db: _damage_page(db, "messages_by_conversation"),
    "table page": lambda db: _damage_page(db, "conversations"),
}


def _answer(key: str, seen: list[str], folder: Path | None = None, monkeypatch=None) -> None:
    """Click ``key`` in the history dialog once it shows (it is modal: exec runs its own loop)."""
    if folder is not None:
        monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))

    def click():
        dialog = QApplication.activeModalWidget()
        if dialog is None or not hasattr(dialog, "buttons"):
            QTimer.singleShot(20, click)
            return
        seen.append(dialog.text.text())
        dialog.buttons[key].click()

    QTimer.singleShot(0, click)


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_history_offers_a_fresh_one_and_keeps_the_old_file(qtbot, tmp_path, damage):
    _history(tmp_path)
    DAMAGE[damage](tmp_path / DB_NAME)
    before = (tmp_path / DB_NAME).read_bytes()
    seen: list[str] = []
    _answer("fresh", seen)
    notes: list[str] = []
    store = open_history(tmp_path, ask_with_dialog, notes=notes)
    assert store is not None
    assert "is damaged" in seen[0] and "\n" not in seen[0]
    assert store.list_conversations() == []
    store.close()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("history-damaged-") and p.suffix == ".sqlite3"]
    assert len(kept) == 1 and kept[0].read_bytes() == before  # nothing of the old file lost
    assert kept[0].name in notes[0]


def test_salvage_reads_past_a_damaged_index(qtbot, tmp_path, make_window):
    _history(tmp_path)
    DAMAGE["index page"](tmp_path / DB_NAME)
    seen: list[str] = []
    _answer("salvage", seen)
    notes: list[str] = []
    store = open_history(tmp_path, ask_with_dialog, notes=notes)
    assert store is not None and "is damaged" in seen[0]
    chats = store.list_conversations()
    assert sorted(c.title for c in chats) == ["chat 0", "chat 1", "chat 2"]
    assert all(len(store.thread(c.id)) == 40 for c in chats)  # every message came across
    assert "Salvaged 3 chats and 120 messages" in notes[0]
    store.close()
    window = make_window(tmp_path)  # and the window opens on it
    assert window.isVisible()


def test_salvage_keeps_what_a_damaged_table_page_leaves(qtbot, tmp_path):
    _history(tmp_path, chats=2, messages=400)  # several pages of messages
    DAMAGE["table page"](tmp_path / DB_NAME)  # the conversations are gone, messages stay
    seen: list[str] = []
    _answer("salvage", seen)
    store = open_history(tmp_path, ask_with_dialog)
    assert store is not None
    rows = store._db.execute("SELECT count(*) FROM messages").fetchone()[0]
    assert rows == 800
    store.close()


def test_another_folder_can_be_chosen(qtbot, tmp_path, monkeypatch):
    bad, good = tmp_path / "bad", tmp_path / "good"
    bad.mkdir()
    (bad / DB_NAME).write_bytes(b"\0" * 4096)
    seen: list[str] = []
    _answer("folder", seen, folder=good, monkeypatch=monkeypatch)
    store = open_history(bad, ask_with_dialog)
    assert store is not None and store.data_dir == good
    store.close()
    assert (bad / DB_NAME).read_bytes() == b"\0" * 4096  # untouched


def test_a_read_only_folder_says_so_and_offers_another(qtbot, tmp_path, monkeypatch):
    ro, other = tmp_path / "ro", tmp_path / "other"
    ro.mkdir()
    if os.geteuid() != 0:
        os.chmod(ro, 0o500)
    else:  # root writes anywhere: let SQLite answer as it does on a read-only folder
        real = history_recovery.HistoryStore

        def store(folder):
            if Path(folder) == ro:
                raise sqlite3.OperationalError("attempt to write a readonly database")
            return real(folder)

        monkeypatch.setattr(history_recovery, "HistoryStore", store)
    seen: list[str] = []
    _answer("folder", seen, folder=other, monkeypatch=monkeypatch)
    try:
        store = open_history(ro, ask_with_dialog)
    finally:
        os.chmod(ro, 0o700)
    assert "is read-only" in seen[0]
    assert store is not None and store.data_dir == other
    store.close()


def test_quit_opens_nothing(qtbot, tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"garbage" * 1000)
    seen: list[str] = []
    _answer("quit", seen)
    assert open_history(tmp_path, ask_with_dialog) is None
    assert (tmp_path / DB_NAME).read_bytes() == b"garbage" * 1000


def test_a_good_history_opens_without_asking(tmp_path):
    _history(tmp_path, chats=1, messages=2)
    store = try_open(tmp_path)
    assert isinstance(store, HistoryStore)
    store.close()
