"""Adapters → Train… on the real engine worker and a tiny random llama: training from two
chats updates the loss chart (a chat message meanwhile is refused with a line), Stop keeps the adapter trained so far, and the adapter is
mounted and on for the chat when training ends, and Compare answers a prompt without
and with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.qt import Qt

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _chat(store, title: str, turns: list[tuple[str, str]]) -> int:
    cid = store.create_conversation(title)
    parent = None
    for user, reply in turns:
        parent = store.add_message(cid, "user", user, parent)
        parent = store.add_message(cid, "assistant", reply, parent)
    return cid


def test_train_from_two_chats_stop_keeps_the_adapter_and_it_mounts(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    first = _chat(window.store, "fox", [("tell me about the fox", "the quick brown fox jumps over the lazy dog")])
    _chat(window.store, "paris", [("what is the capital of france", "paris is the capital and largest city")])
    window.open_conversation(first)
    assert window.adapters_menu.train_action.isEnabled()
    dialog = window.open_training()
    for i in range(dialog.chats.count()):
        dialog.chats.item(i).setCheckState(Qt.CheckState.Checked)
    dialog.iters.setValue(5000)
    dialog.lr.setValue(1e-3)
    dialog.layers.setValue(2)
    dialog.name.setText("from-chats")
    qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(dialog.chart.train) >= 3, timeout=60_000)
    assert "tok/s" in dialog.stats.text() and "left" in dialog.stats.text()
    # A message sent while the model trains is refused with a line, and kept in the composer.
    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, "are you there")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: "training" in window.error_banner.text(), timeout=10_000)
    qtbot.waitUntil(lambda: window.composer.edit.toPlainText() == "are you there", timeout=10_000)
    window.composer.edit.clear()
    dialog.chart.grab()  # paints the line without error
    with qtbot.wait_signal(dialog.finished_training, timeout=60_000) as blocker:
        qtbot.mouseClick(dialog.stop_button, Qt.MouseButton.LeftButton)
    folder, name = blocker.args
    assert name == "from-chats" and (Path(folder) / "adapters.safetensors").is_file()
    assert len(dialog.chart.train) < 5000  # stopped early, the checkpoint kept
    assert "Stopped" in dialog.stats.text()
    qtbot.waitUntil(lambda: "from-chats" in window.adapters_menu.choice(), timeout=30_000)
    assert window.store.conversation(first).adapters == {"from-chats": 1.0}
    # Start is now Resume: it continues from the stopped run's adapter (mounted, but off
    # while training) and mounts the result again under the same name.
    first_run = list(dialog.chart.train)
    assert dialog.start_button.text() == "Resume"
    qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not dialog.start_button.isEnabled(), timeout=10_000)  # the new run began
    qtbot.waitUntil(lambda: len(dialog.chart.train) >= 2, timeout=60_000)
    assert dialog.chart.train[0][1] < first_run[0][1]  # it starts from what was learnt, not afresh
    with qtbot.wait_signal(dialog.finished_training, timeout=60_000):
        qtbot.mouseClick(dialog.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "from-chats" in window.adapters_menu.choice(), timeout=30_000)
    assert [a.name for a in window.bridge.model_info.adapters] == ["from-chats"]
    # One click: a trained chat's first question answered without and with the adapter.
    assert dialog.compare_prompt.text() in ("tell me about the fox", "what is the capital of france")
    assert dialog.compare_button.isEnabled()
    qtbot.mouseClick(dialog.compare_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.comparisons == 1, timeout=60_000)
    assert "…" not in (dialog.without_answer.toPlainText(), dialog.with_answer.toPlainText())
    assert dialog.without_answer.toPlainText()  # the base model's greedy answer (it does not stop at once)
    assert "Could not compare" not in dialog.stats.text()
    assert window.bridge.model_info.active_adapters == {"from-chats": 1.0}  # the chat's choice is back
