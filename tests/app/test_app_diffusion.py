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

    def on_draft(_rid: int, text: str) -> None:  # runs after the controller handed it to the view
        view = window.chat_view
        view._flush()
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
