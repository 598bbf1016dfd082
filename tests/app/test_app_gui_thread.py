"""What the GUI thread no longer does in a long chat: showing a chat writes nothing, the
transcript refills the widgets it freed (and a refilled widget shows only its new message),
the saved caches' folder is read on another thread, and Qt's void calls cannot exhaust None."""

from __future__ import annotations

import sys
import threading

import pytest

from app.qt import QLabel

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _chat(store, n: int, word: str, *, reasoning: str = "", stats: dict | None = None) -> int:
    cid = store.create_conversation(word)
    parent = None
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        parent = store.add_message(cid, role, f"{word} {i}", parent)
        if role == "assistant":
            store.update_message(parent, reasoning=reasoning, stats=stats or {})
    return cid


def test_showing_a_chat_writes_nothing_back(qtbot, make_window):
    window = make_window()
    a, b = _chat(window.store, 2, "alpha"), _chat(window.store, 2, "beta")  # settings {}: the model's
    changed: list = []
    window.settings.changed.connect(lambda *args: changed.append(args))
    before = window.store.last_write
    for cid in (a, b, a):
        window.open_conversation(cid)
    assert window.store.last_write is before and changed == []


def test_switching_chats_refills_freed_widgets_with_only_the_new_message(qtbot, make_window):
    window = make_window()
    store, view = window.store, window.chat_view
    first = _chat(store, 6, "alpha", reasoning="deep thought", stats={"generated_tokens": 7})
    leaf = store.conversation(first).leaf_id
    store.add_message(first, "assistant", "alpha again", store.message(leaf).parent_id)  # versions 1/2, 2/2
    second = _chat(store, 6, "beta")
    window.open_conversation(first)
    qtbot.waitUntil(lambda: not view.filling)
    made = {id(w) for w in view.widgets.values()}
    assert not view.widgets[store.conversation(first).leaf_id].prev_button.isHidden()  # ‹ 2/2 ›
    thinking = [w for w in view.widgets.values() if w.reasoning == "deep thought"]
    assert thinking and all(not w.reasoning_toggle.isHidden() and "7 tokens" in w.stats_label.text() for w in thinking)

    window.open_conversation(second)
    qtbot.waitUntil(lambda: not view.filling)
    widgets = view.widgets
    assert {id(w) for w in widgets.values()} & made  # refilled, not all made anew
    thread = store.thread(second)
    assert sorted(widgets) == [m.id for m in thread]
    for m in thread:
        w = widgets[m.id]
        assert (w.message_id, w.role, w.content) == (m.id, m.role, m.content)
        texts = [w.body.itemAt(i).widget().text() for i in range(w.body.count())]
        assert texts and all("alpha" not in t for t in texts) and any(m.content in t for t in texts)
        if w.role == "assistant":  # nothing of the alpha reply it showed before
            assert w.stats_label.text() == "" and w.reasoning == ""
            assert w._reasoning_parts is None or w.reasoning_toggle.isHidden()
            assert w._version_parts is None or w.prev_button.isHidden()
    assert view.live_widgets <= len(widgets) + 2 * 8  # the spares are bounded


def test_the_saved_caches_folder_is_read_off_the_gui_thread(qtbot, make_window, monkeypatch):
    window = make_window()
    caches = window.caches
    readers: list[str] = []
    scan = type(caches).sizes

    def sizes(self):
        readers.append(threading.current_thread().name)
        return scan(self)

    monkeypatch.setattr(type(caches), "sizes", sizes)
    cid = window.store.create_conversation()
    caches.folder.mkdir(parents=True)
    caches.path_for(cid).write_bytes(b"x" * 2048)
    caches.set_budget(1 << 20)
    qtbot.waitUntil(lambda: caches.known == {cid: 2048})
    window.sidebar.reload(cid)
    assert "Saved cache: 2 KB" in window.sidebar.list.currentItem().toolTip()
    assert readers and threading.main_thread().name not in readers


def test_qt_void_calls_never_use_up_none(qtbot):
    """PySide6 6.12 returns None from void methods without a reference; a long session of
    label updates must not bring None's count to zero (an abort, "none_dealloc")."""
    label = QLabel()
    qtbot.addWidget(label)
    for _ in range(100_000):
        label.setText("x")
    if sys.version_info < (3, 12):  # 3.12 makes None immortal itself
        assert sys.getrefcount(None) > 1 << 39
