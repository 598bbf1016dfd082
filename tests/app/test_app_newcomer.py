"""A newcomer's first hour, on the real engine: the cases that once stopped or confused them.

Histories written by an older or a newer app, Settings on a 1280x800 screen, Regenerate,
and a model browser (and a restart) that remembers the models met so far.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.history_recovery import open_history
from app.history_schema import SCHEMA, SCHEMA_VERSION
from app.qt import QApplication, QFileDialog, QPushButton, QTimer, QWidget
from app.store import DB_NAME
from app.tasks import spawn
from app.ui.file_open import open_paths
from app.ui.history_dialog import ask_with_dialog
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

# ---- histories from other versions -------------------------------------------------------------

# What an early version wrote: no reasoning, stats, tool_turns or adapters columns, messages
# without created_at, no preferences table, and no schema version.
OLD_SCHEMA = (
    SCHEMA.replace("    adapters TEXT NOT NULL DEFAULT '{}',\n", "")
    .replace("    reasoning TEXT NOT NULL DEFAULT '',\n", "")
    .replace("    stats TEXT NOT NULL DEFAULT '{}',\n", "")
    .replace("    adapters TEXT NOT NULL DEFAULT '[]',\n    tool_turns TEXT NOT NULL DEFAULT '[]',\n", "")
    .replace(
        "    created_at REAL NOT NULL,\n    updated_at REAL NOT NULL\n);\nCREATE INDEX IF NOT EXISTS messages_by_c",
        "    updated_at REAL NOT NULL\n);\nCREATE INDEX IF NOT EXISTS messages_by_c",
    )
    .split("CREATE TABLE IF NOT EXISTS preferences")[0]
)


def _write_history(folder: Path, schema: str, user_version: int = 0, extra: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(folder / DB_NAME)
    db.executescript(schema + extra)
    db.execute("INSERT INTO conversations (id, title, leaf_id, created_at, updated_at) VALUES (1, 'old chat', 2, 1, 1)")
    cols = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    for mid, role, text in ((1, "user", "how are you?"), (2, "assistant", "fine, thanks")):
        values = {"id": mid, "conversation_id": 1, "parent_id": mid - 1 or None, "role": role, "content": text}
        values.update({k: 1.0 for k in ("created_at", "updated_at") if k in cols})
        values.update({k: "x" for k in ("future_note",) if k in cols})
        db.execute(
            f"INSERT INTO messages ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
            tuple(values.values()),
        )
    db.execute(f"PRAGMA user_version={user_version}")
    db.commit()
    db.close()


def _never_asked(problem):
    raise AssertionError(f"no dialog was expected: {problem.message}")


def _answer(key: str, seen: list[str]) -> None:
    """Click ``key`` in the history dialog once it shows (modal: exec runs its own loop)."""

    def click():
        dialog = QApplication.activeModalWidget()
        if dialog is None or not hasattr(dialog, "buttons"):
            QTimer.singleShot(20, click)
            return
        seen.append(dialog.text.text())
        seen.extend(sorted(dialog.buttons))
        dialog.buttons[key].click()

    QTimer.singleShot(0, click)


def test_an_older_history_is_migrated_and_its_chat_shows(qtbot, tmp_path, make_window):
    data = tmp_path / "data"
    _write_history(data, OLD_SCHEMA)
    store = open_history(data, _never_asked)
    assert store is not None
    store.close()
    with sqlite3.connect(data / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    window = make_window(data)
    assert [m.content for m in window.store.thread(1)] == ["how are you?", "fine, thanks"]
    assert [e.key for e in window.chat_view.entries] == [1, 2]
    assert [window.chat_view.widgets[i].content for i in (1, 2)] == ["how are you?", "fine, thanks"]
    window.store.add_message(1, "user", "and now?", 2)  # later writes land in the migrated file
    window.store.flush()
    assert window.store.thread(1)[-1].content == "and now?"


@pytest.mark.parametrize("choice", ["fresh", "salvage"])
def test_a_newer_history_opens_the_recovery_dialog(qtbot, tmp_path, make_window, choice):
    data = tmp_path / "data"
    # A newer app's file: a version from the future and a column this one cannot fill.
    _write_history(
        data,
        SCHEMA,
        user_version=SCHEMA_VERSION + 7,
        extra="ALTER TABLE messages ADD COLUMN future_note TEXT NOT NULL;",
    )
    before = (data / DB_NAME).read_bytes()
    seen: list[str] = []
    notes: list[str] = []
    _answer(choice, seen)
    store = open_history(data, ask_with_dialog, notes)
    assert store is not None
    assert "newer version of MLX Desk" in seen[0]
    assert {"fresh", "salvage", "folder", "quit"} <= set(seen[1:])
    kept = [p for p in data.iterdir() if p.name.startswith("history-newer-") and p.suffix == ".sqlite3"]
    assert len(kept) == 1 and kept[0].read_bytes() == before  # the newer app's file, untouched
    titles = [c.title for c in store.list_conversations()]
    assert titles == (["old chat"] if choice == "salvage" else [])
    if choice == "salvage":
        assert [m.content for m in store.thread(1)] == ["how are you?", "fine, thanks"]
    assert kept[0].name in notes[0]
    store.close()
    window = make_window(data)  # and the window opens on it
    assert window.isVisible()


# ---- Settings on a laptop's screen -----------------------------------------------------------------


def test_settings_fit_a_1280x800_screen_and_scroll(qtbot, make_window):
    window = make_window()
    window.resize(1280, 800)
    window.settings_toggle.setChecked(True)
    qtbot.waitUntil(lambda: window.settings.isVisible())
    QApplication.processEvents()
    qtbot.wait(50)
    assert window.width() <= 1280 and window.height() <= 800
    assert window.minimumSizeHint().height() <= 800
    panel = window.settings
    # The panel is whole inside the window, and its fields scroll within it.
    right = panel.mapTo(window, panel.rect().bottomRight())
    assert 0 < right.x() < window.width() and 0 < right.y() < window.height()
    body = panel.scroll.widget()
    assert body.height() > panel.scroll.viewport().height()
    assert panel.scroll.verticalScrollBar().maximum() > 0
    assert body.width() <= panel.scroll.viewport().width()  # nothing cut off at the side
    # No field lies over another: each visible row starts below the one before it ends.
    rows = sorted(
        (w.geometry() for w in body.findChildren(QWidget) if w.parent() is body and w.isVisible()),
        key=lambda g: g.top(),
    )
    for upper, lower in zip(rows, rows[1:], strict=False):
        if upper.right() >= lower.left() and lower.right() >= upper.left():  # the same column
            assert lower.top() > upper.bottom(), (upper, lower)
    panel.scroll.verticalScrollBar().setValue(panel.scroll.verticalScrollBar().maximum())
    reset = next(b for b in body.findChildren(QPushButton) if b.text() == "Reset to model defaults")
    bottom = reset.mapTo(panel.scroll.viewport(), reset.rect().bottomLeft())
    assert 0 <= bottom.y() <= panel.scroll.viewport().height()  # the last field can be reached


# ---- Regenerate --------------------------------------------------------------------------------


def test_regenerate_shows_one_version_while_and_after_it_streams(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings={"max_tokens": 24, "temperature": 1.0, "seed": None})
    window.composer.edit.setPlainText("tell me a story")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as first:
        window.composer.send_button.click()
    first_id = first.args[0]
    user_id = window.store.message(first_id).parent_id

    seen_while_streaming: list[list[int]] = []

    def look(*_):
        if not seen_while_streaming:
            seen_while_streaming.append([e.key for e in window.chat_view.entries])

    window.bridge.token.connect(look)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as second:
        window.chat_view.widgets[first_id].action_button.click()  # "Regenerate"
    second_id = second.args[0]
    assert seen_while_streaming and seen_while_streaming[0] == [user_id, second_id]
    assert [e.key for e in window.chat_view.entries] == [user_id, second_id]
    assert first_id not in window.chat_view.widgets
    assert window.chat_view.widgets[second_id].version_label.text() == "2/2"
    window.chat_view.widgets[second_id].prev_button.click()  # ‹ brings the first back, alone
    assert [e.key for e in window.chat_view.entries] == [user_id, first_id]


# ---- the model browser remembers; a restart reloads the last model ---------------------------------


def _rows(browser) -> dict[str, bool]:
    """Model name -> whether the row is shown as the loaded one (bold)."""
    return {
        browser.table.item(r, 0).text(): browser.table.item(r, 0).font().bold() for r in range(browser.table.rowCount())
    }


def test_browser_remembers_models_and_a_restart_reloads_the_last(qtbot, make_window, run_async, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing in the cache
    first = make_tiny_llama(tmp_path / "models" / "first-model")
    shelf = tmp_path / "shelf"
    make_tiny_llama(shelf / "shelf-model", seed=1)
    data = tmp_path / "data"
    window = make_window(data)
    assert run_async(window.load_model(str(first)))

    browser = window.open_model_browser()
    qtbot.waitUntil(lambda: "first-model" in _rows(browser), timeout=30_000)
    assert _rows(browser)["first-model"] is True  # the loaded model, marked
    qtbot.waitUntil(lambda: browser.table.item(0, 6).text() != "…", timeout=30_000)  # inspected
    assert (
        browser.table.item(0, 6).text() == "✓ fits (2,048 tok)"
    )  # as far as the model reads, not what memory would hold
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(shelf))
    browser.findChild(QPushButton, "addFolder").click()
    qtbot.waitUntil(lambda: "shelf-model" in _rows(browser), timeout=30_000)
    browser.close()

    reopened = window.open_model_browser()  # reopening forgets neither
    qtbot.waitUntil(lambda: {"first-model", "shelf-model"} <= set(_rows(reopened)), timeout=30_000)
    assert len(_rows(reopened)) == 2  # each once
    reopened.close()
    window.close()
    window.store.close()

    restarted = make_window(data)  # the app started again on the same data folder
    task = spawn(open_paths(restarted, []))
    qtbot.waitUntil(task.done, timeout=60_000)
    assert restarted.bridge.model_info is not None
    assert Path(restarted.bridge.model_info.path) == first
    assert "first-model" in restarted.model_button.text()
    browser = restarted.open_model_browser()
    qtbot.waitUntil(lambda: {"first-model", "shelf-model"} <= set(_rows(browser)), timeout=30_000)
    assert "No models on this computer yet" not in browser.results_title.text()
