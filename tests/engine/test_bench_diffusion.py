"""The DiffusionGemma bench shapes: the published 26B-A4B dimensions, the block loop's
figures (every block takes every step on random weights), and mlx-vlm's DiffusionGemma
holding the very same weights (checked where mlx-vlm is installed)."""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.cli.bench import SHAPES, build_model
from engine.cli.main import main
from engine.models import get_family

HAS_MLX_VLM = importlib.util.find_spec("mlx_vlm") is not None


def test_diffusion_gemma_26b_a4b_has_the_published_size():
    """About 25-26B parameters, ~4B active: counted on the lazily built model."""
    family = get_family("diffusion_gemma")
    args = family.ModelArgs.from_dict(dict(SHAPES["diffusion-gemma-26b-a4b"]))
    model = family.Model(args)
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 25.0e9 < total < 26.5e9
    assert args.canvas_length == 256 and args.num_experts == 128 and args.top_k_experts == 8


def test_bench_reports_whole_blocks_and_every_step(capsys):
    code = main(
        ["bench", "--shape", "diffusion-gemma-tiny", "--bits", "16", "-p", "9", "-g", "20"]
        + ["--denoising-steps", "3", "--json"]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours = out["engine"]
    assert out["canvas_length"] == 16 and out["max_denoising_steps"] == 3
    assert ours["blocks"] == 2 and ours["generated_tokens"] == 32  # -g rounded up to whole blocks
    assert ours["denoising_steps"] == 6  # random weights are never confident: every step taken
    assert ours["prompt_tokens"] == 9 and ours["generation_tps"] > 0 and ours["step_ms"] > 0


def test_bench_refuses_the_wrong_referee_in_one_line(capsys):
    assert main(["bench", "--shape", "diffusion-gemma-tiny", "--vs", "mlx-lm"]) != 0
    assert "--vs mlx-vlm goes with --media image|video or the DiffusionGemma shapes" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--vs", "mlx-vlm"]) != 0
    assert main(["bench", "--shape", "tiny", "--profile"]) != 0  # a one-stream text bench has no parts to show
    assert "--profile goes with --concurrent N,N,... or a DiffusionGemma shape" in capsys.readouterr().err
    if not HAS_MLX_VLM:
        assert main(["bench", "--shape", "diffusion-gemma-tiny", "--vs", "mlx-vlm", "-g", "2"]) != 0
        assert "needs mlx-vlm" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MLX_VLM, reason="mlx-vlm is not installed (the bench's optional referee)")
def test_mlx_vlm_twin_holds_the_same_weights():
    """At 4 bits, computed in float32 (bf16 rounding flips a random router's near-ties), the
    twin's prompt cache and first denoising logits equal ours."""
    from engine.cli.bench_diffusion_mlx_vlm import mlx_vlm_twin
    from engine.models.kv_cache import make_prompt_cache

    model, config, quantized = build_model("diffusion-gemma-tiny", 4, 64)
    twin = mlx_vlm_twin(model, config, quantized, 3)
    model.set_dtype(mx.float32)
    twin.set_dtype(mx.float32)
    prompt = mx.random.randint(0, 512, (1, 30), key=mx.random.key(1))
    canvas = mx.random.randint(0, 512, (1, 16), key=mx.random.key(2))
    cache = make_prompt_cache(model)
    model.encode(prompt, cache)
    theirs = twin.make_cache()
    twin.diffusion_prefill_cache(prompt.astype(mx.int32), cache=theirs)
    ours = model.denoise(canvas, cache)
    assert mx.abs(ours - twin.diffusion_decoder_logits(canvas, cache=theirs)).max().item() < 1e-4


def test_profile_takes_one_denoising_step_apart(capsys):
    """``--profile`` reports each part of a step; the tiny shape has MoE layers, so the
    routed experts are timed too."""
    code = main(
        ["bench", "--shape", "diffusion-gemma-tiny", "--bits", "4", "-p", "9", "-g", "2"]
        + ["--denoising-steps", "2", "--profile", "--json"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    parts = json.loads(printed.strip().splitlines()[-1])["engine"]["parts"]
    assert "one denoising step by part" in printed
    assert set(parts) == {
        "canvas input",
        "attention",
        "feed-forward",
        "of which routed experts",
        "head",
        "sampler",
        "one pass, unsplit",
        "one step of the block loop",
    }
    assert all(parts[k] > 0 for k in parts if k != "sampler") and parts["sampler"] >= 0
