"""Ask with choices in the window, on the real engine worker and a tiny random llama: the
options typed in the composer come back as a bar chart of probabilities under the
question, the same numbers ``python -m engine decide --chat`` prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.qt import Qt

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]


def test_ask_with_choices_shows_the_chart(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    composer = window.composer
    qtbot.mouseClick(composer.choices_button, Qt.MouseButton.LeftButton)
    assert composer.choices.isVisibleTo(window)
    qtbot.keyClicks(composer.choices.edit, "paris | the lazy dog | hello")
    composer.edit.setFocus()
    qtbot.keyClicks(composer.edit, "what is the capital of france")
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    chart = window.choices_result.chart
    qtbot.waitUntil(lambda: len(chart.items) == 3, timeout=60_000)
    assert window.choices_result.isVisibleTo(window)
    assert window.choices_result.question.text() == "what is the capital of france"
    labels = [label for label, _ in chart.items]
    probabilities = [p for _, p in chart.items]
    assert labels == ["paris", "the lazy dog", "hello"]
    assert sum(probabilities) == pytest.approx(1.0)
    chart.grab()  # paints the bars without error
    reference = subprocess.run(
        [sys.executable, "-m", "engine", "decide", "--model", str(tiny_model), "--chat",
         "--prompt", "what is the capital of france", "--candidate", "paris", "--candidate", "the lazy dog",
         "--candidate", "hello", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    expected = json.loads(reference.stdout.strip().splitlines()[-1])["probabilities"]
    assert probabilities == pytest.approx(expected, abs=1e-5)
    assert composer.edit.toPlainText() == ""  # the question went


def test_choices_without_options_are_refused_and_kept(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    composer = window.composer
    composer.choices_button.setChecked(True)
    qtbot.keyClicks(composer.edit, "a question")
    with qtbot.wait_signal(composer.refused, timeout=5_000) as blocker:
        qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    assert "at least one option" in blocker.args[0]
    assert composer.edit.toPlainText() == "a question"
