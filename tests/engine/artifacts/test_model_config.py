"""config.json / generation_config.json normalisation and its errors."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from tiny_checkpoints import TINY_LLAMA

from engine.artifacts.config import read_config
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.runtime.loading import load_model


def write(folder, config, generation=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path):
    folder = write(
        tmp_path / "m",
        {**TINY_LLAMA, "eos_token_id": 128001},
        {
            "eos_token_id": [128001, 128008, 128009],
            "bos_token_id": 128000,
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.0,
            "max_new_tokens": 300,
        },
    )
    cfg = read_config(folder)
    assert cfg.model_type == "llama"
    assert cfg.eos_token_ids == [128001, 128008, 128009]
    assert cfg.bos_token_id == 1  # config.json's own value comes first
    assert cfg.generation_defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "max_new_tokens": 300,
    }
    assert cfg.context_length == 512
    assert cfg.quantization is None and not cfg.vision and not cfg.audio


def test_do_sample_false_means_greedy(tmp_path):
    folder = write(tmp_path / "m", TINY_LLAMA, {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.1})
    assert read_config(folder).generation_defaults == {"temperature": 0.0, "repetition_penalty": 1.1}


def test_rope_parameters_spelling_becomes_rope_theta_and_scaling(tmp_path):
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    new = {k: v for k, v in TINY_LLAMA.items() if k != "rope_theta"} | {"rope_parameters": llama3}
    cfg = read_config(write(tmp_path / "new", new))
    assert cfg.raw["rope_theta"] == 500000.0
    assert cfg.raw["rope_scaling"]["rope_type"] == "llama3"
    assert cfg.raw["rope_scaling"]["factor"] == 8.0
    assert "rope_theta" not in cfg.raw["rope_scaling"]

    plain = {k: v for k, v in TINY_LLAMA.items() if k != "rope_theta"}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg = read_config(write(tmp_path / "plain", plain))
    assert cfg.raw["rope_theta"] == 1000000.0 and cfg.raw["rope_scaling"] is None


def test_both_rope_spellings_load_to_the_same_model(checkpoint):
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old_cfg = {**TINY_LLAMA, "rope_theta": 500000.0, "rope_scaling": llama3}
    new_cfg = {k: v for k, v in TINY_LLAMA.items() if k != "rope_theta"}
    new_cfg["rope_parameters"] = {**llama3, "rope_theta": 500000.0}
    plain_cfg = dict(TINY_LLAMA)
    old = load_model(checkpoint("old", config=old_cfg, seed=3).path).model
    new = load_model(checkpoint("new", config=new_cfg, seed=3).path).model
    plain = load_model(checkpoint("plain", config=plain_cfg, seed=3).path).model
    ids = mx.array([list(range(1, 120))])
    assert mx.array_equal(old(ids), new(ids)).item()
    assert not mx.allclose(old(ids), plain(ids)).item()  # the scaling really took effect


def test_multimodal_wrapper_keeps_text_config(tmp_path):
    gemma = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    cfg = read_config(write(tmp_path / "g", gemma))
    assert cfg.model_type == "gemma3"
    assert cfg.text is cfg.raw["text_config"]
    assert cfg.text["rope_theta"] == 1000000.0
    assert cfg.text["rope_local_base_freq"] == 10000.0
    assert cfg.text["rope_scaling"]["rope_type"] == "linear"
    assert cfg.context_length == 131072
    assert cfg.vision and not cfg.audio
    assert cfg.eos_token_ids == [1, 106]


def test_quantization_block_with_per_layer_overrides(tmp_path):
    block = {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
        "lm_head": False,
    }
    cfg = read_config(write(tmp_path / "q", {**TINY_LLAMA, "quantization": block, "quantization_config": block}))
    q = cfg.quantization
    assert (q.bits, q.group_size, q.mode) == (4, 64, "affine")
    assert q.params_for("model.layers.0.mlp.down_proj") == {"bits": 8, "group_size": 32, "mode": "affine"}
    assert q.params_for("model.layers.1.mlp.down_proj") == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert q.params_for("lm_head") is None
    assert q.describe() == "4-bit g64 (mixed)"


def test_other_quantization_methods_are_recognised_as_foreign(tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    cfg = read_config(write(tmp_path / "g", {**TINY_LLAMA, "quantization_config": gptq}))
    assert cfg.quantization is None and cfg.foreign_quantization == "gptq"


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        read_config(tmp_path / "empty")


def test_corrupt_json_names_file_and_line(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(ModelLoadError) as err:
        read_config(folder)
    message = str(err.value)
    assert "config.json is not valid JSON (line 3" in message and "\n" not in message


def test_missing_model_type(tmp_path):
    folder = write(tmp_path / "m", {k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    with pytest.raises(ModelLoadError, match="has no model_type"):
        read_config(folder)


def test_unknown_model_type_is_refused_by_name(checkpoint):
    ckpt = checkpoint()
    config = json.loads((ckpt.path / "config.json").read_text())
    config["model_type"] = "mamba9000"
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="mamba9000.*llama"):
        load_model(ckpt.path)
