"""DiffusionGemma in the window, over the real worker: each block is shown refining (muted,
replaced in place) and then settles; the saved reply is the engine CLI's for the same seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_app_adapters import ROOT, _ready, _send

from tests.tiny_diffusion_gemma import make_tiny_diffusion_gemma

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

SEED, MAX_TOKENS, PROMPT = 3, 24, "hello there"


def _engine_cli(model: Path) -> dict:
    """The referee: the engine's CLI, same chat prompt, seed and length."""
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(model), "--chat", "--prompt", PROMPT]
        + ["--seed", str(SEED), "--max-tokens", str(MAX_TOKENS), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_blocks_refine_in_place_then_settle_to_the_engines_text(qtbot, make_window, run_async, tmp_path, monkeypatch):
    from engine.decode import diffusion

    monkeypatch.setattr(diffusion, "DRAFT_INTERVAL_S", 0.0)  # the tiny model's steps take microseconds
    folder = make_tiny_diffusion_gemma(tmp_path / "tiny-diffusion-gemma", steps=6)
    window = make_window()
    _ready(window, run_async, folder, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=False)

    shown: list[tuple[str, str]] = []  # (settled answer, refining block) as the view drew them

    def on_draft(_rid: int, text: str, reasoning: str) -> None:  # runs after the controller handed it to the view
        view = window.chat_view
        view._flush()
        assert reasoning == ""  # the template does not think
        assert view.streaming is not None and view.streaming.draft_label.text() == text
        assert view.streaming.draft_label.isVisibleTo(view.streaming) == bool(text)
        shown.append((view.streaming.content, text))

    window.bridge.draft.connect(on_draft)
    reply_id, result = _send(qtbot, window, PROMPT)

    expected = _engine_cli(folder)
    assert result.text == expected["text"] and result.token_ids == expected["token_ids"]
    assert result.denoising_steps == expected["denoising_steps"]
    # Several drafts per block, the canvas changing while the settled text stays put, and
    # a later block refining after the first one settled.
    assert len(shown) == result.denoising_steps
    firsts = [text for settled, text in shown if settled == ""]
    assert len(firsts) == 6 and len(set(firsts)) > 1
    assert any(settled for settled, _ in shown)
    # Settled: the reply is its text only, nothing left refining, and the store has it.
    widget = window.chat_view.widgets[reply_id]
    assert not widget.draft_label.isVisibleTo(widget) and widget.content == result.text
    assert window.store.message(reply_id).content == result.text


def test_a_thinking_templates_drafts_refine_in_the_reasoning_without_markers(
    qtbot, make_window, run_async, tmp_path, monkeypatch
):
    """A template whose generation prompt opens ``<think>``: the model's text is thinking,
    and so is each refining canvas. It grows the reasoning section (settled thinking, then
    the block refining), never the muted answer line, and no marker is shown."""
    from engine.decode import diffusion
    from tests.tiny_models import CHATML_TEMPLATE

    monkeypatch.setattr(diffusion, "DRAFT_INTERVAL_S", 0.0)
    folder = make_tiny_diffusion_gemma(tmp_path / "thinking-diffusion-gemma", steps=4)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML_TEMPLATE.replace("assistant\n' }}", "assistant\n<think>\n' }}")
    assert config["chat_template"] != CHATML_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    window = make_window()
    _ready(window, run_async, folder, seed=SEED, max_tokens=16, ignore_eos=True)

    shown: list[tuple[str, str]] = []  # (settled reasoning, refining thinking)

    def on_draft(_rid: int, text: str, reasoning: str) -> None:
        view = window.chat_view
        view._flush()
        widget = view.streaming
        assert text == "" and not widget.draft_label.isVisibleTo(widget)  # nothing in the answer's muted line
        settled = window.chat._reasoning
        assert reasoning and widget.reasoning == settled + reasoning
        assert "<think>" not in widget.reasoning and widget.reasoning_toggle.isVisibleTo(widget)
        shown.append((settled, reasoning))

    window.bridge.draft.connect(on_draft)
    reply_id, result = _send(qtbot, window, PROMPT)
    assert result.text == "" and result.reasoning and "<think>" not in result.reasoning
    assert len(shown) == result.denoising_steps == 8  # two blocks, four steps each
    assert shown[0][0] == "" and shown[-1][0] != ""  # the second block refines after the first settled
    widget = window.chat_view.widgets[reply_id]
    assert widget.reasoning == result.reasoning and not widget.draft_label.isVisibleTo(widget)
    assert window.store.message(reply_id).reasoning == result.reasoning


def test_a_photo_goes_to_diffusion_gemma_and_the_reply_is_the_engines(
    qtbot, make_window, run_async, shared_data, tmp_path
):
    """The image golden (tests/golden/diffusion_gemma/diffusion_gemma_image) is a whole model
    folder: the photo dropped on the message box reaches its vision tower, and the reply
    equals the CLI's with ``--image`` for the same seed."""
    from tests.app.test_app_images import drop, url_mime

    folder = ROOT / "tests" / "golden" / "diffusion_gemma" / "diffusion_gemma_image"
    question = json.loads((folder / "diffusion.json").read_text())["messages"][0]["content"][-1]["text"]
    photo = tmp_path / "cat.png"
    photo.write_bytes((shared_data / "images" / "chelsea.png").read_bytes())
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--chat", "--prompt", question]
        + ["--image", str(photo), "--seed", str(SEED), "--max-tokens", "16", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = json.loads(proc.stdout.strip().splitlines()[-1])

    window = make_window()
    _ready(window, run_async, folder, seed=SEED, max_tokens=16, ignore_eos=False)
    assert window.bridge.model_info.vision
    assert drop(window.composer, url_mime(photo)).isAccepted()
    window.composer.edit.setPlainText(question)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=120_000) as blocker:
        window.composer.send_button.click()
    result = blocker.args[1]
    assert result.token_ids == expected["token_ids"] and result.denoising_steps == expected["denoising_steps"]
    assert result.stats.prompt_tokens == expected["prompt_tokens"]
    assert window.bridge.engine_status()["tower_loaded"]
