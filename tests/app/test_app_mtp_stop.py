"""Stop pressed while the first MTP reply reads the built-in MTP layer, over the real worker
on a tiny random Qwen3.5-layout model: the read stops between its chunks, the reply ends as
stopped, the app is idle, and the next reply reads the layer afresh and drafts."""

from __future__ import annotations

import threading

import pytest
from test_app_adapters import _ready, _regenerate, _send
from test_app_mtp import hybrid_folder

from engine.api import ProgressEvent
from engine.runtime import loading

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def test_stop_during_the_mtp_read_ends_the_reply_as_stopped(
    qtbot, make_window, run_async, tiny_model, tmp_path, monkeypatch
):
    monkeypatch.setattr(loading, "READ_CHUNK_BYTES", 8 << 10)  # the tiny layer reads in several chunks
    window = make_window()
    _ready(window, run_async, hybrid_folder(tiny_model, tmp_path / "hybrid-mtp", True), max_tokens=8)
    window.settings.speculative_box.setCurrentIndex(3)  # Built-in (MTP)
    said: list[str] = []
    window.chat.status.connect(said.append)

    # Stop is pressed when the GUI hears of the first chunk read; the worker holds after the
    # second until then, as a read of a real layer (gigabytes) would still be going on. (A tap
    # runs before its event is handed to the GUI: holding at the first would never let it hear.)
    pressed = threading.Event()
    chunks: list[float] = []

    def hold(event: object) -> bool:  # on the worker thread
        if isinstance(event, ProgressEvent) and event.stage == "load":
            chunks.append(event.done)
            if len(chunks) == 3:
                pressed.wait(30)
        return False

    def press_stop(request_id: int, stage: str, done: float, total: float, message: str) -> None:
        if stage == "load" and done > 0 and not pressed.is_set():
            window.stop()  # what the Stop button and Esc call
            pressed.set()

    window.bridge.add_event_tap(hold)
    window.bridge.progress.connect(press_stop)
    reply_id, result = _send(qtbot, window)
    window.bridge.remove_event_tap(hold)
    window.bridge.progress.disconnect(press_stop)

    # Stopped between chunks: one or two read, not the rest.
    assert pressed.is_set() and len(chunks) in (2, 3) and 0 < chunks[-1] < window.bridge.model_info.plan.mtp_bytes
    assert result.finish_reason == "cancelled" and result.token_ids == [] and result.stats.draft_tokens == 0
    saved = window.store.message(reply_id)
    assert (saved.role, saved.content, saved.status) == ("assistant", "", "cancelled")
    assert "stopped" in window.chat_view.widgets[reply_id].stats_label.text()
    assert said[-1] == "Stopped."
    # Idle: no reply under way, Send ready, nothing decoding in the engine.
    assert window.chat.reply_id is None and not window.chat.busy
    assert window.bridge.active_generation is None and window.composer.send_button.text() == "Send"
    assert window.bridge.worker.status.decoding == 0

    # The layer is still unread: the next reply reads it from the start, then drafts.
    said.clear()
    _, drafted = _regenerate(qtbot, window, reply_id)
    assert [s for s in said if s.startswith("Reading the built-in MTP layer")]
    assert drafted.finish_reason == "length" and drafted.stats.draft_tokens > 0
