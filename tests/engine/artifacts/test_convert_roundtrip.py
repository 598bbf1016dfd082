"""convert: a Hugging Face folder to an MLX folder that the loader reads back."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_checkpoints import PROMPT, WIDE_LLAMA

from engine.artifacts.weights import find_weights
from engine.cli.convert import convert
from engine.errors import ModelLoadError
from engine.runtime.loading import load_model


def hf_folder(checkpoint):
    ckpt = checkpoint("hf", config=WIDE_LLAMA, dtype=mx.float32, generation_config={"eos_token_id": [2, 7]})
    (ckpt.path / "tokenizer.json").write_text('{"model": {}}')
    (ckpt.path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (ckpt.path / "modeling_custom.py").write_text("raise SystemExit\n")
    return ckpt


def test_quantized_conversion_round_trips(checkpoint, tmp_path):
    ckpt = hf_folder(checkpoint)
    out = convert(
        ckpt.path,
        tmp_path / "mlx",
        quantize_bits=4,
        group_size=64,
        overrides={"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}, "lm_head": False},
        shard_bytes=60_000,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {
        "bits": 4,
        "group_size": 64,
        "mode": "affine",
        "lm_head": False,
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
    }
    assert config["quantization_config"] == config["quantization"]
    assert len(find_weights(out)) > 1
    assert {p.name for p in out.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors.index.json",
    }
    assert not (out / "modeling_custom.py").exists()

    loaded = load_model(out)
    assert loaded.config.eos_token_ids == [2, 7]
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    assert type(loaded.model.lm_head).__name__ == "Linear"
    # The same quantization applied in memory to the original model gives the same logits.
    expected = ckpt.model

    def predicate(path, module):
        if path == "lm_head" or not hasattr(module, "to_quantized"):
            return False
        return {"bits": 8, "group_size": 32} if path == "model.layers.0.mlp.down_proj" else True

    nn.quantize(expected, group_size=64, bits=4, class_predicate=predicate)
    assert mx.array_equal(loaded.model(PROMPT), expected(PROMPT)).item()


def test_dtype_conversion(checkpoint, tmp_path):
    ckpt = hf_folder(checkpoint)
    out = convert(ckpt.path, tmp_path / "bf16", dtype="bfloat16")
    loaded = load_model(out)
    assert loaded.dtype == "bfloat16" and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "quantization" not in json.loads((out / "config.json").read_text())
    ckpt.model.set_dtype(mx.bfloat16)
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()


def test_convert_refusals(checkpoint, tmp_path):
    ckpt = hf_folder(checkpoint)
    with pytest.raises(ModelLoadError, match="choose 32, 64 or 128"):
        convert(ckpt.path, tmp_path / "x", quantize_bits=4, group_size=48)
    with pytest.raises(ModelLoadError, match="cannot quantize to 7 bits"):
        convert(ckpt.path, tmp_path / "x", quantize_bits=7)
    done = convert(ckpt.path, tmp_path / "q", quantize_bits=8)
    with pytest.raises(ModelLoadError, match="already exists and is not empty"):
        convert(ckpt.path, done, quantize_bits=8)
    with pytest.raises(ModelLoadError, match="already quantized"):
        convert(done, tmp_path / "qq", quantize_bits=4)
