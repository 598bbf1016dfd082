"""Adapters that do not fit are refused with one readable line, and the model stays as it was."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.errors import AdapterError, EngineError
from engine.models import get_family
from engine.models import lora as adapters
from engine.models.lora import LoRAHost


def small_llama(hidden: int):
    family = get_family("llama")
    args = family.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
        }
    )
    return family.Model(args)


def write_mlxlm(folder, tensors, kind="lora", scale=2.0):
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
    config = {
        "fine_tune_type": kind,
        "num_layers": 2,
        "model": "/home/me/models/Some-Base-7B",
        "lora_parameters": {"rank": 4, "scale": scale, "dropout": 0.0},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and text
    return text


def test_shape_mismatch_names_both_shapes_and_the_base(golden_dir):
    model = small_llama(32)
    with pytest.raises(AdapterError) as err:
        adapters.mount(model, golden_dir / "mlxlm_qv")
    text = one_line(err.value)
    assert "expects q_proj 64->64 but the model has 32->32" in text
    assert "different base model (tiny-random-llama?)" in text
    assert not [m for _, m in model.named_modules() if isinstance(m, LoRAHost)]


def test_unknown_target_module(tiny_llama, tmp_path):
    a = mx.zeros((64, 4))
    b = mx.ones((4, 64))
    folder = write_mlxlm(
        tmp_path / "far",
        {
            "model.layers.0.self_attn.q_proj.lora_a": a,
            "model.layers.0.self_attn.q_proj.lora_b": b,
            "model.layers.7.self_attn.q_proj.lora_a": a,
            "model.layers.7.self_attn.q_proj.lora_b": b,
        },
    )
    with pytest.raises(AdapterError) as err:
        adapters.mount(tiny_llama, folder)
    text = one_line(err.value)
    assert "model.layers.7.self_attn.q_proj" in text and "Some-Base-7B" in text
    # Refused as a whole: layer 0 was not touched either.
    assert isinstance(tiny_llama.model.layers[0].self_attn.q_proj, nn.Linear)
    assert adapters.mounted(tiny_llama) == []


def test_non_linear_target_is_refused(tiny_llama, tmp_path):
    folder = write_mlxlm(
        tmp_path / "norm",
        {
            "model.layers.0.input_layernorm.lora_a": mx.zeros((64, 4)),
            "model.layers.0.input_layernorm.lora_b": mx.zeros((4, 64)),
        },
    )
    with pytest.raises(AdapterError, match="RMSNorm; only linear layers"):
        adapters.mount(tiny_llama, folder)


def test_missing_and_damaged_files(tiny_llama, tmp_path, golden_dir):
    with pytest.raises(AdapterError, match="does not exist"):
        adapters.mount(tiny_llama, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        adapters.mount(tiny_llama, tmp_path / "empty")
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(golden_dir / "peft_qv" / "adapter_config.json", cfg_only)
    with pytest.raises(AdapterError, match="no adapters.safetensors"):
        adapters.mount(tiny_llama, cfg_only)
    (cfg_only / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AdapterError, match="pickle"):
        adapters.mount(tiny_llama, cfg_only)
    broken = tmp_path / "broken"
    shutil.copytree(golden_dir / "peft_qv", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="damaged"):
        adapters.mount(tiny_llama, broken)
    half = write_mlxlm(tmp_path / "half", {"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((64, 4))})
    with pytest.raises(AdapterError, match="lacks lora_a or lora_b"):
        adapters.mount(tiny_llama, half)
    dora_no_m = write_mlxlm(
        tmp_path / "dora_no_m",
        {
            "model.layers.0.self_attn.q_proj.lora_a": mx.zeros((64, 4)),
            "model.layers.0.self_attn.q_proj.lora_b": mx.zeros((4, 64)),
        },
        kind="dora",
    )
    with pytest.raises(AdapterError, match="magnitude"):
        adapters.mount(tiny_llama, dora_no_m)
    full = write_mlxlm(tmp_path / "full", {"model.layers.0.self_attn.q_proj.weight": mx.zeros((64, 64))}, kind="full")
    with pytest.raises(AdapterError, match="'full' fine-tune"):
        adapters.mount(tiny_llama, full)


def test_peft_extras_are_refused(tiny_llama, tmp_path, golden_dir):
    folder = tmp_path / "extra"
    shutil.copytree(golden_dir / "peft_qv", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["modules_to_save"] = ["lm_head"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="lm_head"):
        adapters.mount(tiny_llama, folder)


def test_names_and_activation_errors(tiny_llama, golden_dir):
    adapters.mount(tiny_llama, golden_dir / "peft_qv", name="qv")
    with pytest.raises(AdapterError, match="already mounted"):
        adapters.mount(tiny_llama, golden_dir / "peft_vo_mlp", name="qv")
    with pytest.raises(AdapterError, match="not mounted .*mounted: qv"):
        adapters.activate(tiny_llama, {"nope": 1.0})
    with pytest.raises(AdapterError, match="finite"):
        adapters.activate(tiny_llama, {"qv": float("nan")})
    with pytest.raises(EngineError, match="not mounted"):
        adapters.unmount(tiny_llama, "nope")
    x = mx.ones((1, 2, 64))
    q = tiny_llama.model.layers[0].self_attn.q_proj
    np.testing.assert_array_equal(np.array(q(x)), np.array(q.base(x)))  # failed calls left it inactive


def test_wrapper_prefixes_are_renamed_like_checkpoint_weights(tmp_path):
    """A Gemma 3 adapter trained on the multimodal checkpoint names language_model.model.layers...;
    the family's own weight renaming finds the layer."""
    family = get_family("gemma3_text")
    args = family.ModelArgs.from_dict(
        {
            "model_type": "gemma3_text",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": 64,
            "query_pre_attn_scalar": 8,
        }
    )
    model = family.Model(args)
    folder = write_mlxlm(
        tmp_path / "g3",
        {
            "language_model.model.layers.1.self_attn.q_proj.lora_a": mx.ones((32, 4)),
            "language_model.model.layers.1.self_attn.q_proj.lora_b": mx.ones((4, 32)),
        },
    )
    info = adapters.mount(model, folder)
    assert info.targets == ["model.layers.1.self_attn.q_proj"]
    assert isinstance(model.model.layers[1].self_attn.q_proj, LoRAHost)
