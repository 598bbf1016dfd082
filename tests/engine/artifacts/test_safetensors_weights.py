"""Safetensors discovery and header parsing, checked against the safetensors library."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from tiny_checkpoints import WIDE_LLAMA

from engine.artifacts.config import read_config
from engine.artifacts.weights import find_weights, parameter_count, read_header, read_headers
from engine.errors import ModelLoadError
from engine.runtime.loading import load_model


def test_headers_agree_with_the_safetensors_library(checkpoint):
    ckpt = checkpoint(shards=3)
    files = find_weights(ckpt.path)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    headers = read_headers(files)
    seen = 0
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                assert headers[name].shape == tuple(sl.get_shape())
                assert headers[name].dtype == sl.get_dtype()
                assert headers[name].file == file
                seen += 1
    assert seen == len(headers)
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    assert sum(i.nbytes for i in headers.values()) == index["metadata"]["total_size"]


def test_missing_shard_is_named(checkpoint):
    ckpt = checkpoint(shards=3)
    (ckpt.path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing model-00002-of-00003.safetensors.*download it again"):
        load_model(ckpt.path)


def test_truncated_shard_is_caught_before_loading(checkpoint):
    ckpt = checkpoint(shards=3)
    shard = ckpt.path / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    expected = f"model-00002-of-00003.safetensors is truncated (expected {len(data)} bytes, found {len(data) - 100}): download it again"
    with pytest.raises(ModelLoadError) as err:
        read_header(shard)
    assert str(err.value) == expected
    calls = []
    with pytest.raises(ModelLoadError, match="is truncated"):
        load_model(ckpt.path, progress=lambda done, total: calls.append(done))
    assert calls == []  # refused before any layer was read


def test_file_cut_inside_its_header(checkpoint):
    ckpt = checkpoint()
    file = ckpt.path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:50])
    with pytest.raises(ModelLoadError, match="model.safetensors is truncated"):
        read_header(file)


def test_garbage_header(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}")
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        read_header(file)


def test_unindexed_files_are_globbed_and_consolidated_skipped(checkpoint):
    ckpt = checkpoint(shards=2)
    (ckpt.path / "model.safetensors.index.json").unlink()
    (ckpt.path / "consolidated.safetensors").write_bytes(b"")
    assert [f.name for f in find_weights(ckpt.path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_no_weights(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="holds no \\*.safetensors"):
        find_weights(tmp_path / "m")


@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (8, 32), (4, 128)])
def test_parameter_count_of_quantized_checkpoints_matches_the_float_one(checkpoint, bits, group_size):
    plain = checkpoint("plain", config=WIDE_LLAMA)
    quant = checkpoint(
        "quant",
        config=WIDE_LLAMA,
        bits=bits,
        group_size=group_size,
        overrides={"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}},
    )
    expected = parameter_count(read_headers(find_weights(plain.path)))
    counted = parameter_count(read_headers(find_weights(quant.path)), read_config(quant.path).quantization)
    assert counted == expected
    h, i, v, n = WIDE_LLAMA["hidden_size"], WIDE_LLAMA["intermediate_size"], WIDE_LLAMA["vocab_size"], 2
    kv = 2 * (h // WIDE_LLAMA["num_attention_heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    assert expected == 2 * v * h + h + n * per_layer
