"""A history that cannot take writes (full disk, read-only drive): the user is told,
nothing already saved is lost, the app stays up, and the reply is saved once it can be."""

from __future__ import annotations

import pytest

from app.qt import Qt

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _ready(window, run_async, tiny_model) -> None:
    assert run_async(window.load_model(str(tiny_model)))
    window.new_chat()
    window.store.update_conversation(window.chat.conversation_id, settings={"max_tokens": 8, "temperature": 0.0})


def test_full_disk_refuses_the_message_and_keeps_it_in_the_box(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    _ready(window, run_async, tiny_model)
    store = window.store
    # SQLite's own "database or disk is full": the file may not grow by one page (set on the
    # connection that writes, the store's writer thread's).
    (pages,) = store.on_writer(lambda db: db.execute("PRAGMA page_count").fetchone())
    store.on_writer(lambda db: db.execute(f"PRAGMA max_page_count={pages}"))
    long_text = "a long message that needs new pages " * 200
    window.composer.edit.setPlainText(long_text)
    with qtbot.wait_signal(window.chat.failed, timeout=10_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert "disk is full" in blocker.args[0] and "still in the box" in blocker.args[0]
    qtbot.waitUntil(lambda: window.composer.edit.toPlainText() == long_text.strip(), timeout=5_000)
    assert window.store.thread(window.chat.conversation_id) == []
    assert not window.chat.busy

    # Space again: the same message goes out and is answered.
    store.on_writer(lambda db: db.execute("PRAGMA max_page_count=1073741823"))
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    roles = [m.role for m in window.store.thread(window.chat.conversation_id)]
    assert roles == ["user", "assistant"]


def test_reply_that_cannot_be_saved_stays_and_is_saved_later(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    _ready(window, run_async, tiny_model)
    window.chat._retry_timer.setInterval(50)
    store = window.store
    failures: list[str] = []
    window.chat.failed.connect(failures.append)

    def lock_on_first_token(*_):
        store.on_writer(lambda db: db.execute("PRAGMA query_only=ON"))  # as on a read-only drive

    window.bridge.token.connect(lock_on_first_token)
    window.composer.edit.setPlainText("hello there")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    message_id, result = blocker.args
    window.bridge.token.disconnect(lock_on_first_token)
    qtbot.waitUntil(lambda: any("read-only" in f and "saved as soon as it can be" in f for f in failures))
    assert window.chat_view.widgets[message_id].isVisible()
    on_disk = store.on_writer(lambda db: db.execute("SELECT status FROM messages WHERE id=?", (message_id,)).fetchone())
    assert on_disk == ("streaming",)  # the final save did not land

    store.on_writer(lambda db: db.execute("PRAGMA query_only=OFF"))
    with qtbot.wait_signal(window.chat.status, timeout=5_000, check_params_cb=lambda text: "saved again" in text):
        pass
    saved = window.store.message(message_id)
    assert saved.content == result.text and saved.status == "complete"
    on_disk = store.on_writer(
        lambda db: db.execute("SELECT content, status FROM messages WHERE id=?", (message_id,)).fetchone()
    )
    assert on_disk == (result.text, "complete")
