"""The memory gauge over the real engine: live figures, tooltip, and the budget warning."""

from __future__ import annotations

import pytest

from app.memory_units import fmt_bytes
from app.qt import Qt

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def test_gauge_figures_and_overflow_warning(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert "machine" in window.gauge.label.text()  # before any model: the machine's memory
    assert run_async(window.load_model(str(tiny_model)))
    plan = window.bridge.model_info.plan
    weights, per_token = plan.weights_bytes, plan.kv_bytes_per_token
    assert weights > 0 and per_token > 0
    # Reload with a budget that 1,000 tokens of KV cache fill exactly.
    budget = weights + per_token * 1000
    assert run_async(window.load_model(str(tiny_model), memory_budget=budget))
    gauge = window.gauge
    assert gauge.figures["budget_bytes"] == budget and gauge.figures["weights_bytes"] == weights
    assert gauge.level == "ok"

    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings={"max_tokens": 40, "ignore_eos": True, "temperature": 0.0})
    window.settings.load("", window.store.conversation(conv).settings)
    window.composer.edit.setPlainText("fill some memory")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    result = blocker.args[1]
    # Live figures from the engine's MemoryEvents.
    f = gauge.figures
    assert f["active_bytes"] > 0 and f["peak_bytes"] >= f["active_bytes"] > 0
    assert f["kv_bytes"] > 0 and f["total_bytes"] > 0
    tip = gauge.toolTip()
    for word in ("MLX active", "MLX cache", "Peak", "weights", "KV cache", "Budget", "Machine"):
        assert word in tip
    context = result.stats.prompt_tokens + result.stats.generated_tokens
    assert window.chat.context_tokens() == context
    assert f"{context:,} + 40 tokens" in tip

    # Raise Max tokens until the projected reply nears, then passes, the budget.
    messages: list[str] = []
    window.statusBar().messageChanged.connect(messages.append)
    amber_tokens = int(0.95 * 1000) - context  # 95% of the budget
    window.settings.inputs["max_tokens"].setValue(amber_tokens)
    assert gauge.level == "amber"
    assert any("nearing the memory budget" in m for m in messages)
    assert gauge.label.property("level") == "amber"
    assert not window.error_banner.isVisible()

    window.settings.inputs["max_tokens"].setValue(2000)
    assert gauge.level == "red"
    assert window.error_banner.isVisible()
    assert "may not fit in memory" in window.error_banner.text()
    assert "may not fit" in gauge.toolTip()

    window.settings.inputs["max_tokens"].setValue(40)
    assert gauge.level == "ok" and gauge.warning == ""


def test_gauge_shows_the_enforced_kv_allowance_and_what_happens_at_it(qtbot, make_window, run_async, tiny_model):
    """The label shows the KV caches against what the budget leaves them beside the weights
    (the figure the engine evicts idle chats' caches at), and the tooltip says so."""
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    weights = window.bridge.model_info.plan.weights_bytes
    budget = weights + 3 * 1024**2
    assert run_async(window.load_model(str(tiny_model), memory_budget=budget))
    status = window.bridge._worker.status
    assert status.budget_bytes == budget and status.kv_allowance_bytes == budget - weights
    window.store.update_conversation(window.chat.conversation_id, settings={"max_tokens": 4, "ignore_eos": True})
    window.composer.edit.setPlainText("hello")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    gauge = window.gauge
    assert gauge.figures["kv_allowance_bytes"] == budget - weights  # from the engine's MemoryEvent
    assert f"of {fmt_bytes(budget - weights)}" in gauge.label.text().split("·")[1]
    tip = gauge.toolTip()
    assert "The budget is enforced" in tip and "refused before it loads" in tip
    assert f"may hold {fmt_bytes(budget - weights)}" in tip and "least recently used" in tip
