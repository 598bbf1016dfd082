"""gpt-oss, Ministral 3 and SmolLM3 in the layouts they ship in, loaded the way the app
loads models (tests/golden/mlx_layouts, made by tests/golden/make_family_goldens_gptoss.py).

``gpt_oss_hf_mxfp4`` is OpenAI's release layout (MXFP4 expert blocks/scales), judged by
transformers. Every ``*_mlx_*`` folder is mlx-lm's ``convert`` output (gpt-oss: of that
release as is, dequantized, re-quantized to mxfp4 and to affine 4-bit; Ministral 3: affine
4 and 8 bits; SmolLM3: affine 4-bit, nvfp4 and mxfp8), judged by mlx-lm's own greedy ids and
log-probs on that folder. All in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from test_families import greedy

from engine.runtime.loading import load_model

LAYOUTS = Path(__file__).resolve().parents[2] / "golden" / "mlx_layouts"
NAMES = sorted(p.name for p in LAYOUTS.iterdir() if (p / "expected.json").is_file())
TOLERANCE = 2e-3


def test_every_layout_is_there():
    assert {
        "gpt_oss_hf_mxfp4",
        "gpt_oss_mlx_mxfp4",
        "gpt_oss_mlx_bf16",
        "gpt_oss_mlx_q_mxfp4",
        "gpt_oss_mlx_q4",
        "ministral3_mlx_q4",
        "ministral3_mlx_q8",
        "smollm3_mlx_q4",
        "smollm3_mlx_nvfp4",
        "smollm3_mlx_mxfp8",
    } <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_the_referee(name):
    folder = LAYOUTS / name
    expected = json.loads((folder / "expected.json").read_text())
    model = load_model(folder, dtype="float32").model
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert ids == expected["greedy_ids"]
    worst = max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"]))
    assert worst < TOLERANCE, f"{name}: log-prob differs by {worst}"


def test_release_experts_run_as_mxfp4():
    """OpenAI's blocks/scales are not dequantized: they feed MLX's mxfp4 matmul as they are."""
    model = load_model(LAYOUTS / "gpt_oss_hf_mxfp4").model
    experts = model.layers[0].mlp.experts
    assert experts.gate_proj.mode == "mxfp4" and experts.gate_proj.weight.dtype == mx.uint32
    assert experts.down_proj.scales.dtype == mx.uint8
    assert model.layers[0].mlp.router.weight.dtype == mx.bfloat16  # left as the release has it


def test_mixed_mode_router_is_affine():
    """mlx-lm's mxfp4 models keep gpt-oss's routers at affine 8 bits, g64."""
    router = load_model(LAYOUTS / "gpt_oss_mlx_q_mxfp4").model.layers[1].mlp.router
    assert (router.mode, router.bits, router.group_size) == ("affine", 8, 64)
