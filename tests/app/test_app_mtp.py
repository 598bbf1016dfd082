"""Settings → Speculative decoding → "Built-in (MTP)" over the real worker, on a tiny random
Qwen3.5-layout model (DeltaNet + gated attention) with and without its MTP layer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_app_adapters import _ready, _regenerate, _send

from engine.runtime.memory import format_bytes

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def hybrid_folder(tiny_model: Path, folder: Path, with_mtp: bool) -> Path:
    """The tiny llama's tokenizer and settings around a random Qwen3.5-layout model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.models import get_family
    from engine.models.qwen3_5_mtp import MTPHead

    shutil.copytree(tiny_model, folder)
    base = json.loads((tiny_model / "config.json").read_text())
    config = {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": base["vocab_size"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": base["eos_token_id"],
        "bos_token_id": base.get("bos_token_id"),
        "mtp_num_hidden_layers": 1,
    }
    (folder / "config.json").write_text(json.dumps(config))
    family = get_family("qwen3_5_text")
    mx.random.seed(5)
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if with_mtp:
        head = MTPHead(model.args, model.model.layer_class)
        weights.update({"mtp." + k: v for k, v in tree_flatten(head.parameters())})
    for f in folder.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def test_mtp_choice_follows_the_model(qtbot, make_window, run_async, tiny_model, tmp_path):
    with_mtp = hybrid_folder(tiny_model, tmp_path / "hybrid-mtp", True)
    without = hybrid_folder(tiny_model, tmp_path / "hybrid-converted", False)
    window = make_window()
    box = window.settings.speculative_box
    mtp_item = box.model().item(3)
    assert box.itemText(3) == "Built-in (MTP)" and not mtp_item.isEnabled()  # no model yet

    _ready(window, run_async, with_mtp, max_tokens=24)
    assert mtp_item.isEnabled()
    plain_id, plain = _send(qtbot, window)
    assert plain.stats.draft_tokens == 0
    box.setCurrentIndex(3)
    assert window.store.conversation(window.chat.conversation_id).settings["speculative"] == "mtp"
    mtp_id, drafted = _regenerate(qtbot, window, plain_id)
    assert drafted.text == plain.text  # greedy: the drafts never change the reply
    assert drafted.stats.draft_tokens > 0
    assert "the built-in MTP layer" in window.chat_view.widgets[mtp_id].stats_label.toolTip()

    # A copy without the MTP layers (as mlx-lm converts): greyed out, saying why; a chat
    # that asks for it decodes plainly and says so.
    assert run_async(window.load_model(str(without)))
    assert not mtp_item.isEnabled() and "mlx-lm" in mtp_item.toolTip()
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as done:
        with qtbot.wait_signal(
            window.chat.status, timeout=60_000, check_params_cb=lambda text: "without MTP drafting" in text
        ):
            window.chat_view.widgets[mtp_id].action_button.click()
    assert done.args[1].stats.draft_tokens == 0


def test_the_first_mtp_reply_shows_the_layer_being_read(qtbot, make_window, run_async, tiny_model, tmp_path):
    """The MTP layer is read on the first reply that drafts with it: the status bar says so
    once, and the reply's footer follows the read; later replies draft at once."""
    window = make_window()
    _ready(window, run_async, hybrid_folder(tiny_model, tmp_path / "hybrid-mtp", True), max_tokens=8)
    said: list[str] = []
    window.chat.status.connect(lambda text: said.append(text) if "MTP layer" in text else None)
    footers: list[str] = []

    def shown(request_id: int, stage: str, done: float, total: float, message: str) -> None:
        # After the controller took the event (it connected first): the footer as painted.
        if stage == "load":
            window.chat_view._flush()
            footers.append(window.chat_view.streaming.stats_label.text())

    window.bridge.progress.connect(shown)
    plain_id, _ = _send(qtbot, window)
    assert said == [] and footers == []  # plain decoding never reads it

    window.settings.speculative_box.setCurrentIndex(3)
    first_id, first = _regenerate(qtbot, window, plain_id)
    size = window.bridge.model_info.plan.mtp_bytes
    assert said == [f"Reading the built-in MTP layer ({format_bytes(size)})…"]
    assert footers[0].startswith(f"Reading the built-in MTP layer ({format_bytes(size)})… 0%  ·  ")
    assert not footers[-1].startswith("Reading the built-in")  # read: back to the prompt's progress
    assert first.stats.draft_tokens > 0

    seen = len(footers)
    _, second = _regenerate(qtbot, window, first_id)
    assert len(said) == 1 and len(footers) == seen and second.stats.draft_tokens > 0
