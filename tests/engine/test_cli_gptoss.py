"""Broken gpt-oss folders through ``python -m engine generate``: one line, non-zero exit."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx

from tests.engine.cli_run import ROOT, generate, one_line_failure

LAYOUTS = ROOT / "tests" / "golden" / "mlx_layouts"


def test_unknown_quantization_mode_is_refused_naming_the_known_ones(tmp_path):
    folder = shutil.copytree(LAYOUTS / "gpt_oss_mlx_q_mxfp4", tmp_path / "odd-mode")
    config = json.loads((folder / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key]["mode"] = "fp3x"
    (folder / "config.json").write_text(json.dumps(config))
    err = one_line_failure(generate(folder))
    assert "'fp3x'" in err and all(mode in err for mode in ("affine", "mxfp4", "mxfp8", "nvfp4"))


def test_unknown_mode_of_one_layer_is_refused_too(tmp_path):
    folder = shutil.copytree(LAYOUTS / "gpt_oss_mlx_q_mxfp4", tmp_path / "odd-layer")
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["model.layers.1.mlp.router"]["mode"] = "int3"
    (folder / "config.json").write_text(json.dumps(config))
    assert "'int3'" in one_line_failure(generate(folder))


def test_experts_missing_from_the_index_and_shard(tmp_path):
    folder = shutil.copytree(LAYOUTS / "gpt_oss_mlx_mxfp4", tmp_path / "no-experts")
    weights = mx.load(str(folder / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if ".layers.1.mlp.experts." not in k}
    mx.save_safetensors(str(folder / "model.safetensors"), kept, metadata={"format": "mlx"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in kept}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = one_line_failure(generate(folder))
    assert "model.layers.1.mlp.experts" in err


def test_release_experts_missing_their_scales(tmp_path):
    """OpenAI's layout with an index that lost the MXFP4 scales of one layer."""
    folder = shutil.copytree(LAYOUTS / "gpt_oss_hf_mxfp4", tmp_path / "no-scales")
    weights = mx.load(str(folder / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.endswith("layers.0.mlp.experts.down_proj_scales")}
    mx.save_safetensors(str(folder / "model.safetensors"), kept, metadata={"format": "pt"})
    err = one_line_failure(generate(folder))
    assert "layers.0.mlp.experts.down_proj" in err
