"""Every quantization mode mlx-lm writes, against mlx-lm itself.

Each folder under tests/golden/quant/ is mlx-lm's own ``convert -q`` output of a tiny
checkpoint (tests/golden/make_quant_goldens.py), with mlx-lm's greedy ids and log-probs
on it. The engine loads the folder as a user's download and must give the same ids and
log-probs within 2e-3 (both sides in float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from model_goldens import greedy

from engine.artifacts.config import config_from_dict
from engine.decode.loop import generate_step
from engine.models.kv_cache import make_prompt_cache
from engine.models.stacked import stack_projections
from engine.models.switch import QuantizedSwitchLinear
from engine.runtime.loading import load_model
from engine.runtime.model_info import format_inspect, inspect_model

TOLERANCE = 2e-3
QUANT = Path(__file__).resolve().parents[2] / "golden" / "quant"
CASES = sorted(p.name for p in QUANT.iterdir() if (p / "expected.json").is_file())
# with mlx-lm's greedy reference (the nvfp4 global-scale case has none: MLX runs it on GPUs only)
GENERATED = [c for c in CASES if "greedy_ids" in json.loads((QUANT / c / "expected.json").read_text())]


def test_every_mode_has_a_case():
    modes = {json.loads((QUANT / c / "config.json").read_text())["quantization"]["mode"] for c in CASES}
    assert modes == {"affine", "mxfp4", "mxfp8", "nvfp4"}
    bits = {json.loads((QUANT / c / "config.json").read_text())["quantization"]["bits"] for c in CASES}
    assert {2, 3, 4, 5, 6, 8} <= bits
    assert any("mixed" in c for c in CASES) and any(c.startswith("qwen3_moe") for c in CASES)


@pytest.mark.parametrize("case", GENERATED)
def test_greedy_matches_mlx_lm(case):
    expected = json.loads((QUANT / case / "expected.json").read_text())
    loaded = load_model(QUANT / case, dtype="float32")
    ids, logprobs = greedy(loaded.model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert ids == expected["greedy_ids"], case
    worst = max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"]))
    assert worst < TOLERANCE, f"{case}: log-prob differs by {worst}"


@pytest.mark.parametrize("case", CASES)
def test_memory_plan_and_inspect_count_what_mlx_lm_holds(case):
    """The plan (from file headers alone) is the bytes mlx-lm's loaded model holds, and
    ``inspect`` reports mlx-lm's own bits per weight (scales and biases included)."""
    expected = json.loads((QUANT / case / "expected.json").read_text())
    info = inspect_model(QUANT / case, memory_budget=10**9)
    assert info.plan.weights_bytes == expected["model_bytes"]
    assert info.parameters == expected["parameters"]
    assert f"({expected['bits_per_weight']:.2f} bits per weight)" in format_inspect(info)
    mode = expected["quantization"]["mode"]
    assert info.quantization.startswith("" if mode == "affine" else mode)


@pytest.mark.parametrize("case", [c for c in GENERATED if "b4_g64" in c or "fp" in c or "mixed" in c])
def test_engine_decode_loop_matches_mlx_lm(case):
    """The decode loop generation uses (stacked q/k/v and gate/up, compiled step) on each
    non-affine mode and the mixes: the stacked matmuls carry each layer's mode along."""
    expected = json.loads((QUANT / case / "expected.json").read_text())
    model = load_model(QUANT / case, dtype="float32").model
    stack_projections(model)
    prompt = mx.array(expected["prompt_ids"], dtype=mx.uint32)
    steps = list(
        generate_step(
            prompt,
            model,
            make_prompt_cache(model),
            max_tokens=len(expected["greedy_ids"]),
            logprobs=True,
            compiled=True,
        )
    )
    assert [t for t, _ in steps] == expected["greedy_ids"], case
    worst = max(abs(lp - ref) for (_, lp), ref in zip(steps, expected["logprobs"]))
    assert worst < TOLERANCE, f"{case}: log-prob differs by {worst}"


def test_nvfp4_experts_with_a_global_scale_per_expert():
    """mlx-lm's ``quantize_model(global_scale=True)`` layout: each expert of each switch
    layer computes x @ W^T with W as MLX dequantizes it with that expert's scale (MLX's
    own referee; its CPU kernels multiply by no global scale, the engine applies it)."""
    folder = QUANT / "qwen3_moe_nvfp4_global_scale"
    model = load_model(folder, dtype="float32").model
    layers = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert layers and all("global_scale" in m for m in layers)
    for layer in layers:
        experts, out_dims = layer.weight.shape[:2]
        x = mx.random.normal((5, 1, 1, layer.scales.shape[-1] * layer.group_size), key=mx.random.key(1))
        indices = mx.array([[e % experts, (e + 1) % experts] for e in range(5)])
        y = layer(x, indices)
        dense = mx.stack(
            [
                mx.dequantize(
                    layer.weight[e], layer.scales[e], None, 16, 4, mode="nvfp4", global_scale=layer.global_scale[e]
                )
                for e in range(experts)
            ]
        )
        expected = x @ dense[indices].swapaxes(-1, -2)
        assert y.shape == expected.shape == (5, 2, 1, out_dims)
        assert mx.allclose(y, expected, atol=1e-4, rtol=1e-4).item()
    ids, _ = greedy(model, [5, 6, 7, 8], 4)  # the whole model runs on this machine
    assert len(ids) == 4


def test_config_spellings_of_the_modes():
    """``quantization`` or ``quantization_config``; gpt-oss's own ``quant_method: mxfp4``
    block (no bits) is mxfp4 4-bit g32, as mlx-lm reads it; other methods stay foreign."""
    base = {"model_type": "qwen3"}
    spec = config_from_dict({**base, "quantization_config": {"group_size": 16, "bits": 4, "mode": "nvfp4"}})
    assert spec.quantization.describe() == "nvfp4 4-bit g16"
    gpt_oss = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    spec = config_from_dict({**base, "quantization_config": gpt_oss})
    assert (spec.quantization.mode, spec.quantization.bits, spec.quantization.group_size) == ("mxfp4", 4, 32)
    assert spec.quantization.overrides == {} and spec.foreign_quantization is None
    assert config_from_dict({**base, "quantization_config": {"quant_method": "awq"}}).foreign_quantization == "awq"
    # a module's own entry replaces the default whole: no mode there means affine
    block = {"group_size": 32, "bits": 4, "mode": "mxfp4", "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
    spec = config_from_dict({**base, "quantization": block}).quantization
    assert spec.params_for("model.layers.0.mlp.gate") == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert spec.params_for("model.layers.0.mlp.up_proj") == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
