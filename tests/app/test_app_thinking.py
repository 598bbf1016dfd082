"""The "Thinking" control over the real engine, on a tiny model whose tokenizer_config
carries the real Qwen3 template (../shared/data/chat_templates): shown only for a template
with a reasoning switch, starting at the template's own default, saved with the chat, and
really changing the prompt the engine renders from the next reply on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.controllers.chat import build_params

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

SEND = {"max_tokens": 2, "ignore_eos": True, "temperature": 0.0}


def _with_template(tiny_model: Path, tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "models" / "tiny-thinking"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _send(qtbot, window, text: str):
    window.composer.edit.setPlainText(text)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    reply_id, result = blocker.args
    assert result.finish_reason in ("stop", "length")
    return reply_id, result


def _regenerate(qtbot, run_async, window, reply_id: int):
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        run_async(window.chat.regenerate(reply_id), timeout=120_000)
    _, result = blocker.args
    assert result.finish_reason in ("stop", "length")
    return result


def test_thinking_switch_is_saved_and_changes_the_prompt(
    qtbot, make_window, run_async, tmp_path, tiny_model, shared_data
):
    qwen3 = (shared_data / "chat_templates" / "llama.cpp" / "Qwen-Qwen3-0.6B.jinja").read_text()
    window = make_window()
    panel = window.settings
    assert not panel.thinking_box.isVisibleTo(panel)  # no model yet
    assert run_async(window.load_model(str(_with_template(tiny_model, tmp_path, qwen3))))
    assert panel.thinking_box.isVisibleTo(panel) and not panel.effort_box.isVisibleTo(panel)
    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings=SEND)
    panel.load("", SEND)
    assert panel.thinking_box.isChecked()  # Qwen3 thinks unless told otherwise
    assert "reasoning" not in window.store.conversation(conv).settings
    reply, default = _send(qtbot, window, "hello there")

    panel.thinking_box.setChecked(False)  # saved with the chat, beside the other settings
    saved = window.store.conversation(conv).settings
    assert saved["reasoning"] is False and saved["max_tokens"] == SEND["max_tokens"]
    # The same conversation again: only the switch differs, and Qwen3 writes an empty
    # <think></think> block into the generation prompt when thinking is off.
    off = _regenerate(qtbot, run_async, window, reply)
    assert off.stats.prompt_tokens > default.stats.prompt_tokens
    assert off.stats.cached_tokens < off.stats.prompt_tokens - 1  # the changed tail is prefilled
    control = window.bridge.model_info.reasoning_control
    assert control.variable == "enable_thinking"

    panel.thinking_box.setChecked(True)  # back to the template's default: left undefined
    assert "reasoning" not in window.store.conversation(conv).settings
    assert build_params(window.store.conversation(conv).settings, {}, control).reasoning is None
    on = _regenerate(qtbot, run_async, window, reply)
    assert on.stats.prompt_tokens == default.stats.prompt_tokens

    # Another chat starts at the default; coming back shows this chat's saved choice.
    panel.thinking_box.setChecked(False)
    window.new_chat()
    assert window.chat.conversation_id != conv and panel.thinking_box.isChecked()
    window.open_conversation(conv)
    assert not panel.thinking_box.isChecked()


def test_effort_combo_for_gpt_oss_and_nothing_for_llama3(make_window, run_async, tmp_path, tiny_model, shared_data):
    templates = shared_data / "chat_templates"
    window = make_window()
    panel = window.settings
    gpt_oss = (templates / "llama.cpp" / "openai-gpt-oss-120b.jinja").read_text()
    assert run_async(window.load_model(str(_with_template(tiny_model, tmp_path / "a", gpt_oss))))
    panel.load("", {})
    assert panel.effort_box.isVisibleTo(panel) and not panel.thinking_box.isVisibleTo(panel)
    assert panel.effort_box.currentData() == "medium" and "reasoning" not in panel.values()
    panel.effort_box.setCurrentIndex(panel.effort_box.findData("high"))
    assert panel.values()["reasoning"] == "high"
    control = window.bridge.model_info.reasoning_control
    assert build_params(panel.values(), {}, control).reasoning == "high"
    assert build_params({"reasoning": True}, {}, control).reasoning is None  # not an effort

    llama3 = (templates / "llama.cpp" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    assert run_async(window.load_model(str(_with_template(tiny_model, tmp_path / "b", llama3))))
    assert window.bridge.model_info.reasoning_control is None
    assert not panel.reasoning_title.isVisibleTo(panel)
    assert not panel.effort_box.isVisibleTo(panel) and not panel.thinking_box.isVisibleTo(panel)
    assert "reasoning" not in panel.values(everything=True)
