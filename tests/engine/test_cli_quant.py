"""Quantization through the CLI: bad quantized MoE folders given to ``python -m engine
generate`` (one line, non-zero exit), and ``bench --mode`` for each floating-point mode.

The folders start from mlx-lm's own conversion of the tiny qwen3_moe checkpoint
(tests/golden/quant/), split into two shards with the stacked experts in the second,
as large MoE downloads are.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.engine.cli_run import ROOT, generate, one_line_failure

MOE = ROOT / "tests" / "golden" / "quant" / "qwen3_moe_affine_b4_g32"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def sharded(tmp_path) -> Path:
    """The MoE folder with its experts in a second shard, both listed in the index."""
    folder = tmp_path / "moe"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MOE / name, folder / name)
    weights = mx.load(str(MOE / "model.safetensors"))
    experts = {k: v for k, v in weights.items() if ".switch_mlp." in k}
    rest = {k: v for k, v in weights.items() if k not in experts}
    mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"), rest, metadata={"format": "mlx"})
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), experts, metadata={"format": "mlx"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in rest}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in experts}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_the_sharded_folder_runs(sharded):
    proc = generate(sharded)
    assert proc.returncode == 0, proc.stderr


def test_truncated_expert_shard(sharded):
    shard = sharded / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    err = one_line_failure(generate(sharded))
    assert "model-00002-of-00002.safetensors is truncated" in err and "download it again" in err


def test_experts_missing_from_the_index(sharded):
    index = json.loads((sharded / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".switch_mlp." not in k}
    (sharded / INDEX).write_text(json.dumps(index))
    err = one_line_failure(generate(sharded))
    assert "model.layers.0.mlp.switch_mlp." in err and INDEX in err, err


def test_hf_experts_missing_from_the_index(tmp_path):
    """Hugging Face layout (one tensor per expert): expert 3 in no listed shard."""
    base = ROOT / "tests" / "golden" / "models" / "qwen3_moe"
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(base / "config.json", folder / "config.json")
    weights = mx.load(str(base / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if ".experts.3." not in k}
    mx.save_safetensors(str(folder / "model-00001-of-00001.safetensors"), kept)
    (folder / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(kept, "model-00001-of-00001.safetensors")}))
    err = one_line_failure(generate(folder))
    assert "model.layers.0.mlp.experts.3." in err and INDEX in err, err


@pytest.mark.parametrize(
    "block",
    [
        {"group_size": 64, "bits": 4, "mode": "int4"},
        {"group_size": 32, "bits": 4, "mode": "affine", "model.layers.0.mlp.gate": {"mode": "fp6", "bits": 6}},
    ],
)
def test_unknown_quantization_mode(sharded, block):
    config = json.loads((sharded / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = block
    (sharded / "config.json").write_text(json.dumps(config))
    err = one_line_failure(generate(sharded))
    assert "quantization mode" in err and "mxfp4" in err and "nvfp4" in err, err


def test_bits_mlx_cannot_run(sharded):
    config = json.loads((sharded / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": 48, "bits": 7, "mode": "affine"}
    (sharded / "config.json").write_text(json.dumps(config))
    err = one_line_failure(generate(sharded))
    assert "7 bits with group size 48" in err and "affine (1-6 or 8 bits, group 32, 64, 128)" in err, err


@pytest.mark.parametrize(("mode", "bits", "group_size"), [("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)])
def test_bench_quantizes_in_each_floating_point_mode(mode, bits, group_size):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "bench", "--shape", "tiny", "--mode", mode, "-p", "8", "-g", "2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (data["mode"], data["bits"], data["group_size"]) == (mode, bits, group_size)
    assert data["engine"]["generated_tokens"] == 2
    assert f"({mode} {bits}-bit g{group_size}, random weights)" in proc.stdout
