"""The memory plan counts a checkpoint's appended MTP layers only as far as they load.

DeepSeek V3 / GLM-5 load their first MTP layer (for --mtp drafting) but not its copies of
the embedding and head, nor further MTP layers; GLM-4.5 (glm4_moe) loads none. The plan's
weights must equal what the loaded model holds, byte for byte, and inspect says which part
is the MTP layer and what is stored but not loaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.runtime.loading import load_model
from engine.runtime.model_info import format_inspect, inspect_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import GOLDEN  # noqa: E402
from test_mtp_deepseek import mtp_weights  # noqa: E402


def held_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def folder_with_mtp(tmp_path: Path, name: str, layers: int) -> Path:
    """The golden folder with ``layers`` complete MTP layers appended, bf16 on disk."""
    src = GOLDEN / name
    dst = tmp_path / name
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(src / "model.safetensors")).items()}
    for i in range(layers):
        extra = mtp_weights(weights, n, config["vocab_size"], config["hidden_size"], seed=i)
        weights.update({k.replace(f"model.layers.{n}.", f"model.layers.{n + i}."): v for k, v in extra.items()})
    config["num_nextn_predict_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    return dst


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_the_plan_counts_the_mtp_layer_that_loads_and_nothing_else(tmp_path, name):
    folder = folder_with_mtp(tmp_path, name, layers=2)
    info = inspect_model(folder, memory_budget=1 << 34)
    loaded = load_model(folder, memory_budget=1 << 34)
    model = loaded.model
    assert "mtp" in model
    assert info.plan.weights_bytes == held_bytes(model)
    assert info.plan.mtp_bytes == held_bytes(model.mtp)
    config = json.loads((folder / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    assert loaded.weights_bytes == info.plan.weights_bytes  # the loader's figure is the plan's
    # Left out: the second MTP layer whole, and the first's embedding and head copies.
    stored = sum(v.nbytes for v in mx.load(str(folder / "model.safetensors")).values())
    assert info.plan.left_out_bytes == stored - info.plan.weights_bytes
    assert info.plan.left_out_bytes > 2 * vocab * hidden * 2
    text = format_inspect(info)
    assert "MTP layer" in text and "not loaded" in text


def test_a_family_that_runs_no_mtp_layer_counts_none(tmp_path):
    name = "glm4_moe_published"  # its checkpoint appends part of an MTP layer; glm4_moe leaves it out
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst)
    info = inspect_model(dst, memory_budget=1 << 34)
    model = load_model(dst, memory_budget=1 << 34).model
    assert info.plan.weights_bytes == held_bytes(model)
    assert info.plan.mtp_bytes == 0 and info.plan.left_out_bytes > 0
    assert "MTP layer " not in format_inspect(info)
