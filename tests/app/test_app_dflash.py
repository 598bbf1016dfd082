"""The app's draft-model picker takes a DFlash drafter folder (recognised by its config):
over the real worker, the reply drafted by it is the plain greedy reply, and a drafter made
for another model is refused in the error banner, in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.app.test_app_adapters import _ready, _regenerate, _send

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "speculative"))
from dflash_models import drafter_config, write_drafter  # noqa: E402

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def _drafter_for(model: Path, folder: Path, extra_layers: int = 0) -> Path:
    config = json.loads((model / "config.json").read_text())
    shape = SimpleNamespace(
        args=SimpleNamespace(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"]),
        layers=[None] * (config["num_hidden_layers"] + extra_layers),
    )
    return write_drafter(folder, drafter_config(shape, layer_ids=(0, 1), block=6))


def test_a_dflash_drafter_drafts_the_plain_reply(qtbot, make_window, run_async, tiny_model, tmp_path):
    window = make_window()
    _ready(window, run_async, tiny_model, max_tokens=24)
    plain_id, plain = _send(qtbot, window)
    assert run_async(window.set_draft_model(str(_drafter_for(tiny_model, tmp_path / "other", 2)))) is False
    assert "made for a target with 4 layers" in window.error_banner.text()
    assert "\n" not in window.error_banner.text()
    assert run_async(window.set_draft_model(str(_drafter_for(tiny_model, tmp_path / "dflash"))))
    assert window.settings.draft_label.text() == "Draft: dflash"
    window.settings.speculative_box.setCurrentIndex(2)
    _, drafted = _regenerate(qtbot, window, plain_id)
    assert drafted.text == plain.text
    assert drafted.stats.draft_tokens > 0
