"""Loading folders: dtypes, shards, MLX quantization, errors, progress and cancel."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from tiny_checkpoints import PROMPT, TINY_LLAMA, WIDE_LLAMA

from engine.errors import ModelLoadError, OutOfMemoryBudget
from engine.runtime.loading import load_model


def test_sharded_bf16_folder_loads_with_identical_logits(checkpoint):
    ckpt = checkpoint(shards=3, generation_config={"eos_token_id": [2, 5], "temperature": 0.7})
    seen = []
    loaded = load_model(ckpt.path, progress=lambda done, total: seen.append((done, total)))
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()
    assert loaded.dtype == "bfloat16"
    assert loaded.model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert loaded.config.eos_token_ids == [2, 5]
    assert loaded.tokenizer_path == ckpt.path and loaded.gguf_metadata is None
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    assert loaded.weights_bytes == index["metadata"]["total_size"] == loaded.plan.weights_bytes
    # embed, 2 layers, norm, lm_head: one step each, in order, starting at 0
    assert seen == [(i, 5) for i in range(6)]


def test_fp32_stays_fp32_and_dtype_casts(checkpoint):
    ckpt = checkpoint(dtype=mx.float32)
    kept = load_model(ckpt.path)
    assert kept.dtype == "float32" and kept.model.lm_head.weight.dtype == mx.float32
    assert mx.array_equal(kept.model(PROMPT), ckpt.logits()).item()
    half = load_model(ckpt.path, dtype="float16")
    assert half.dtype == "float16" and half.model.lm_head.weight.dtype == mx.float16
    assert half.weights_bytes == kept.weights_bytes // 2
    assert mx.allclose(half.model(PROMPT).astype(mx.float32), ckpt.logits(), atol=0.1).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mlx_quantized_checkpoints(checkpoint, bits, group_size):
    ckpt = checkpoint(config=WIDE_LLAMA, bits=bits, group_size=group_size, shards=2)
    loaded = load_model(ckpt.path)
    q_proj = loaded.model.model.layers[1].self_attn.q_proj
    assert (q_proj.bits, q_proj.group_size) == (bits, group_size)
    assert loaded.model.model.embed_tokens.bits == bits
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()
    assert loaded.config.quantization.describe() == f"{bits}-bit g{group_size}"


def test_per_layer_overrides_and_skipped_layers(checkpoint):
    overrides = {
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
        "model.layers.1.self_attn.v_proj": {"bits": 6, "group_size": 128},
        "lm_head": False,
    }
    ckpt = checkpoint(config=WIDE_LLAMA, bits=4, group_size=64, overrides=overrides)
    model = load_model(ckpt.path).model
    layers = model.model.layers
    assert (layers[0].mlp.down_proj.bits, layers[0].mlp.down_proj.group_size) == (8, 32)
    assert (layers[1].self_attn.v_proj.bits, layers[1].self_attn.v_proj.group_size) == (6, 128)
    assert (layers[1].mlp.down_proj.bits, layers[1].mlp.down_proj.group_size) == (4, 64)
    assert type(model.lm_head).__name__ == "Linear"
    assert mx.array_equal(model(PROMPT), ckpt.logits()).item()


def test_quantized_weights_without_a_config_block(checkpoint):
    ckpt = checkpoint(config=WIDE_LLAMA, bits=4)
    config = json.loads((ckpt.path / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no quantization block"):
        load_model(ckpt.path)


def test_stored_arrays_decide_where_the_top_level_default_disagrees(checkpoint):
    """As mlx-lm's loader: a module the block does not name takes the packing its stored
    arrays show (a wrong top-level group size loads right); a module the block names
    wrongly does not load, in one readable line."""
    ckpt = checkpoint(config=WIDE_LLAMA, bits=4, group_size=64)
    config = json.loads((ckpt.path / "config.json").read_text())
    config["quantization"]["group_size"] = 32
    (ckpt.path / "config.json").write_text(json.dumps(config))
    loaded = load_model(ckpt.path)
    assert loaded.model.model.layers[0].self_attn.q_proj.group_size == 64
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()
    config["quantization"]["model.layers.0.self_attn.q_proj"] = {"bits": 4, "group_size": 32}
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(ckpt.path)
    assert "weights do not match its config.json" in str(err.value) and "\n" not in str(err.value)


def test_weights_of_another_shape(checkpoint):
    ckpt = checkpoint()
    config = json.loads((ckpt.path / "config.json").read_text())
    config["intermediate_size"] = 96
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="weights do not match its config.json.*mlp"):
        load_model(ckpt.path)


def test_missing_tensor(checkpoint):
    ckpt = checkpoint(shards=2)
    index_file = ckpt.path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    # A tensor the index promises but its shard lacks.
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="does not hold model.layers.0.mlp.extra.weight"):
        load_model(ckpt.path)


def test_too_big_for_the_budget_is_refused_before_loading(checkpoint):
    ckpt = checkpoint()
    calls = []
    with pytest.raises(OutOfMemoryBudget) as err:
        load_model(ckpt.path, memory_budget=100_000, progress=lambda d, t: calls.append(d))
    message = str(err.value)
    weights = sum(f.stat().st_size for f in ckpt.path.glob("*.safetensors"))
    assert message.startswith("tiny needs ")
    assert "for its weights; the memory budget is 100.0 KB (set by --memory-budget)" in message
    assert "Pick a smaller or more quantized model, or raise --memory-budget." in message
    assert weights > 100_000 and calls == []


def test_context_that_does_not_fit_suggests_a_shorter_one(checkpoint):
    ckpt = checkpoint()
    size = load_model(ckpt.path).weights_bytes
    # KV per token: 2 layers x (K and V) x 2 kv heads x 16 dims x 2 bytes = 256 bytes.
    with pytest.raises(OutOfMemoryBudget, match=r"for a 1,000-token context.*at most 390 tokens"):
        load_model(ckpt.path, memory_budget=size + 100_000, context_tokens=1000)


def test_progress_callback_can_cancel(checkpoint):
    ckpt = checkpoint()

    class Stop(Exception):
        pass

    def progress(done, total):
        if done == 2:
            raise Stop

    with pytest.raises(Stop):
        load_model(ckpt.path, progress=progress)


def test_tied_embeddings(checkpoint):
    ckpt = checkpoint(config={**TINY_LLAMA, "tie_word_embeddings": True}, bits=8, group_size=32)
    loaded = load_model(ckpt.path)
    assert not hasattr(loaded.model, "lm_head")
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()


def test_unknown_dtype(checkpoint):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(checkpoint().path, dtype="float8")
