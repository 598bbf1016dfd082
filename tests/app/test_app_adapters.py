"""Adapters menu and speculative decoding over the real worker, on the tiny llama with a
tiny mlx-lm LoRA adapter made here (tests/tiny_models.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.qt import Qt
from tests.tiny_models import make_tiny_adapter

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
PROMPT = "hello there"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_tiny_adapter(tmp_path_factory.mktemp("adapters") / "alpha", seed=3)


def _ready(window, run_async, tiny_model, **settings):
    assert run_async(window.load_model(str(tiny_model)))
    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings={**GREEDY, **settings})
    window.settings.load("", window.store.conversation(conv).settings)


def _send(qtbot, window, text=PROMPT):
    window.composer.edit.setPlainText(text)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    return blocker.args


def _regenerate(qtbot, window, message_id):
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        window.chat_view.widgets[message_id].action_button.click()
    return blocker.args


def _engine_cli(model: Path, *extra: str) -> str:
    """The outside referee: the engine's CLI, greedy, same prompt and length."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(model),
            "--prompt",
            PROMPT,
            "--chat",
            "--temp",
            "0",
            "--max-tokens",
            str(GREEDY["max_tokens"]),
            "--ignore-eos",
            "--json",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["text"]


def test_adapters_menu_toggles_scales_and_remembers_per_conversation(
    qtbot, make_window, run_async, tiny_model, adapter
):
    window = make_window()
    _ready(window, run_async, tiny_model)
    base_id, base = _send(qtbot, window)
    assert base.text == _engine_cli(tiny_model)

    assert run_async(window.mount_adapter(str(adapter)))
    menu = window.adapters_menu
    assert list(menu.rows) == ["alpha"]
    assert not menu.rows["alpha"].check.isChecked()
    assert [a.text() for a in menu.unmount_menu.actions()] == ["alpha"]

    # Tick it: remembered for the conversation and active in the worker.
    menu.rows["alpha"].check.click()
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"alpha": 1.0}, timeout=10_000)
    conv_a = window.chat.conversation_id
    assert window.store.conversation(conv_a).adapters == {"alpha": 1.0}
    on_id, on = _regenerate(qtbot, window, base_id)
    assert on.text != base.text
    assert on.text == _engine_cli(tiny_model, "--adapter", f"{adapter}:1.0")
    assert window.store.message(on_id).adapters == {"alpha": 1.0}
    assert "adapters: alpha ×1" in window.chat_view.widgets[on_id].stats_label.text()

    # Scale 0 leaves the base model's output; untick gives it back exactly too.
    menu.rows["alpha"].scale.setValue(0.0)
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"alpha": 0.0}, timeout=10_000)
    zero_id, zero = _regenerate(qtbot, window, on_id)
    assert zero.text == base.text
    menu.rows["alpha"].scale.setValue(1.0)
    menu.rows["alpha"].check.click()
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {}, timeout=10_000)
    off_id, off = _regenerate(qtbot, window, zero_id)  # the reply on screen (one version shows)
    assert off.text == base.text and window.store.message(off_id).adapters == {}
    assert "adapters" not in window.chat_view.widgets[off_id].stats_label.text()

    # Per conversation: A uses alpha, a new chat B does not; switching re-applies each.
    menu.rows["alpha"].check.click()
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"alpha": 1.0}, timeout=10_000)
    window.new_chat()
    conv_b = window.chat.conversation_id
    assert conv_b != conv_a
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {}, timeout=10_000)
    assert not window.adapters_menu.rows["alpha"].check.isChecked()
    window.store.update_conversation(conv_b, settings=GREEDY)
    _, plain_b = _send(qtbot, window)
    assert plain_b.text == base.text
    window.sidebar.conversation_selected.emit(conv_a)
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"alpha": 1.0}, timeout=10_000)
    assert window.adapters_menu.rows["alpha"].check.isChecked()
    # Each version's footer names its adapters, after the thread is read back from the store.
    window.store.show_version(on_id)
    window.chat.refresh()
    assert "adapters: alpha ×1" in window.chat_view.widgets[on_id].stats_label.text()

    # Unmount from the menu.
    menu = window.adapters_menu
    menu.unmount_menu.actions()[0].trigger()
    qtbot.waitUntil(lambda: not window.bridge.model_info.adapters, timeout=10_000)
    assert window.adapters_menu.rows == {}


def test_mismatched_adapter_is_refused_readably(qtbot, make_window, run_async, tiny_model, tmp_path):
    window = make_window()
    _ready(window, run_async, tiny_model)
    wrong = make_tiny_adapter(tmp_path / "wide", hidden=96, heads=4, kv_heads=2)
    assert run_async(window.mount_adapter(str(wrong))) is False
    assert window.error_banner.isVisible()
    assert "wide" in window.error_banner.text() and "\n" not in window.error_banner.text()
    assert window.adapters_menu.rows == {}


def test_speculative_toggle_keeps_greedy_output_and_reports_acceptance(
    qtbot, make_window, run_async, tiny_model, tmp_path
):
    window = make_window()
    _ready(window, run_async, tiny_model, max_tokens=40)
    plain_id, plain = _send(qtbot, window)
    assert plain.stats.draft_tokens == 0

    # N-gram lookup from the settings panel: same text, drafts counted, speed compared.
    window.settings.speculative_box.setCurrentIndex(1)
    assert window.store.conversation(window.chat.conversation_id).settings["speculative"] == "ngram"
    ngram_id, ngram = _regenerate(qtbot, window, plain_id)
    assert ngram.text == plain.text
    assert ngram.stats.draft_tokens > 0
    footer = window.chat_view.widgets[ngram_id].stats_label
    rate = ngram.stats.accepted_draft_tokens / ngram.stats.draft_tokens
    assert f"accepted {rate:.0%}" in footer.text() and " speed" in footer.text()
    assert "n-gram lookup" in footer.toolTip()
    saved = window.store.message(ngram_id).stats
    assert saved["speedup"] > 0 and saved["speculative"] == "ngram"

    # A draft model with another vocabulary is refused; the model drafting for itself is
    # accepted and, greedy, agrees with every draft.
    other_vocab = shutil.copytree(tiny_model, tmp_path / "other-vocab")
    tok = json.loads((other_vocab / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids with swapped meanings
    (other_vocab / "tokenizer.json").write_text(json.dumps(tok))
    assert run_async(window.set_draft_model(str(other_vocab))) is False
    assert window.error_banner.isVisible() and "vocabulary" in window.error_banner.text()
    draft = shutil.copytree(tiny_model, tmp_path / "self-draft")
    assert run_async(window.set_draft_model(str(draft)))
    assert window.settings.draft_label.text() == "Draft: self-draft"
    window.settings.speculative_box.setCurrentIndex(2)
    draft_id, drafted = _regenerate(qtbot, window, ngram_id)
    assert drafted.text == plain.text
    assert drafted.stats.draft_tokens > 0
    assert drafted.stats.accepted_draft_tokens == drafted.stats.draft_tokens
    assert "accepted 100%" in window.chat_view.widgets[draft_id].stats_label.text()
    assert "a draft model" in window.chat_view.widgets[draft_id].stats_label.toolTip()

    assert run_async(window.set_draft_model(None))
    assert window.settings.draft_label.text() == "No draft model"
