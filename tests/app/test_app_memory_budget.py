"""The memory budget chosen in Settings, over the real worker: it is remembered with the
app's preferences, every load carries it, the gauge shows it, and a model it cannot take
is refused with the way out."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import model_prefs
from app.memory_units import GB, fmt_bytes
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """Still two layers of width 64, but a wide MLP: ~25 MB of weights, more than the
    smallest budget the control offers (0.01 GB), and quick to load."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-wide", intermediate=16384)


def _choose(window, gb: float | None) -> None:
    """Set the budget through the Settings control, as a person would."""
    panel = window.settings
    if gb is None:
        panel.budget_mode.setCurrentIndex(0)
        return
    panel.budget_mode.setCurrentIndex(1)
    panel.budget_value.setValue(gb)


def test_budget_persists_reaches_the_load_and_explains_a_refusal(qtbot, make_window, run_async, wide_model, tmp_path):
    data = tmp_path / "data"
    window = make_window(data)
    window.settings_toggle.setChecked(True)
    panel = window.settings
    machine = window.gauge.figures["total_bytes"]
    assert panel.budget_mode.currentIndex() == 0
    assert panel.budget_mode.itemText(0) == "Automatic"
    assert not panel.budget_value.isEnabled() and panel.budget_value.value() > 0  # shows what it means
    assert panel.budget_value.maximum() == pytest.approx(round(machine / GB, 2))

    # Too small for the model: the engine refuses it, and the message says by how much and
    # that Settings can raise the budget (this machine has room for the model).
    _choose(window, 0.01)
    chosen = int(round(0.01 * GB))
    assert window.store.preference(model_prefs.BUDGET_KEY) == chosen
    assert panel.budget_value.isEnabled()
    failures: list[str] = []
    window.load_failed.connect(failures.append)
    assert run_async(window.load_model(str(wide_model))) is False
    [reason] = failures
    assert "\n" not in reason
    assert f"the memory budget is {fmt_bytes(chosen)} (set in Settings)" in reason
    assert "Raise the memory budget in Settings" in reason
    assert "--memory-budget" not in reason
    assert window.error_banner.isVisible() and reason in window.error_banner.text()
    assert window.bridge.model_info is None
    assert window.gauge.label.text().startswith(f"no model  ·  budget {fmt_bytes(chosen)}")

    # Raised in Settings: the same model loads, under exactly that budget.
    _choose(window, 1.0)
    assert run_async(window.load_model(str(wide_model)))
    plan = window.bridge.model_info.plan
    assert plan.budget_bytes == GB
    assert f"needs {fmt_bytes(plan.weights_bytes)} for its weights" in reason
    assert window.gauge.figures["budget_bytes"] == GB
    assert f"of {fmt_bytes(GB)}" in window.gauge.label.text()

    # Changed while a model is loaded: remembered, applied from the next load, and said so.
    messages: list[str] = []
    window.statusBar().messageChanged.connect(messages.append)
    _choose(window, 0.02)
    assert any("applies from the next load" in m and "would not load" in m for m in messages)
    assert panel.budget_note.isVisible() and "applies from the next load" in panel.budget_note.text()
    assert window.gauge.figures["budget_bytes"] == GB  # the loaded model's own budget
    assert f"Next load: {fmt_bytes(int(round(0.02 * GB)))}" in window.gauge.toolTip()
    _choose(window, 2.0)

    # A restart over the same data folder keeps the choice and loads under it.
    window.close()
    window.store.close()
    again = make_window(data)
    assert again.settings.budget_mode.currentIndex() == 1
    assert again.settings.budget_value.value() == pytest.approx(2.0)
    assert run_async(again.load_model(str(wide_model)))
    assert again.bridge.model_info.plan.budget_bytes == 2 * GB
    assert "applies from the next load" not in again.settings.budget_note.text()
    assert again.settings.budget_note.text() == f"This machine has {fmt_bytes(machine)}."

    # Back to automatic: the engine's own default, which the control then names.
    _choose(again, None)
    assert again.store.preference(model_prefs.BUDGET_KEY) is None
    assert run_async(again.load_model(str(wide_model)))
    automatic = again.bridge.model_info.plan.budget_bytes
    assert automatic != 2 * GB
    assert again.settings.budget_value.value() == pytest.approx(automatic / GB, abs=0.006)
    assert again.gauge.figures["budget_bytes"] == automatic


def test_refusal_message_suggests_settings_only_when_the_machine_has_room():
    budget = model_prefs.BudgetSetting(custom=None, automatic=12 * GB, total=16 * GB)
    raise_it = model_prefs.refusal_message("big-model", 14 * GB, budget)
    assert raise_it == (
        "big-model needs 14.0 GB for its weights; the memory budget is 12.0 GB "
        "(automatic). Raise the memory budget in Settings (up to 16.0 GB on this "
        "machine) to load it, or pick a smaller or more quantized model."
    )
    too_big = model_prefs.refusal_message("huge-model", 40 * GB, budget)
    assert "Raise" not in too_big and "Settings" not in too_big
    assert "more than this machine's 16.0 GB" in too_big
    assert "pick a smaller or more quantized model" in too_big


def test_a_budget_the_history_cannot_save_is_said_and_not_shown_as_kept(qtbot, make_window):
    window = make_window()
    window.settings_toggle.setChecked(True)
    messages: list[str] = []
    window.statusBar().messageChanged.connect(messages.append)
    window.store.on_writer(lambda db: db.execute("PRAGMA query_only=ON"))  # as on a read-only drive
    _choose(window, 3.0)
    assert any("read-only" in m and "not remembered" in m for m in messages)
    assert window.settings.budget_mode.currentIndex() == 0  # back to what is remembered
    window.store.on_writer(lambda db: db.execute("PRAGMA query_only=OFF"))


def test_a_draft_model_that_does_not_fit_says_how_to_make_room(
    qtbot, make_window, run_async, tiny_model, wide_model, tmp_path
):
    window = make_window(tmp_path / "data")
    _choose(window, 0.02)  # room for the tiny model, not for the ~25 MB one beside it
    assert run_async(window.load_model(str(tiny_model)))
    assert run_async(window.set_draft_model(str(wide_model))) is False
    text = window.error_banner.text()
    assert f"{wide_model.name} needs" in text and "beside the" in text
    assert f"raise the memory budget in Settings and load {tiny_model.name} again" in text
    assert "--memory-budget" not in text
    assert window.settings.draft_label.text() == "No draft model"
