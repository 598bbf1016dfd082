"""DiffusionGemma against transformers 5.23 (tests/golden/make_diffusion_gemma_goldens.py):
the network's logits for a fixed noised canvas, and whole block-diffusion generations
fed the random draws transformers made."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from engine.decode.diffusion import DiffusionSettings, RandomNoise, ReplayedNoise, diffuse
from engine.errors import EngineError, UnsupportedModelError
from engine.models import diffusion_gemma, get_family

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "diffusion_gemma"
NAMES = ["diffusion_gemma_tiny", "diffusion_gemma_published"]


def load(name: str):
    folder = GOLDEN / name
    config = json.loads((folder / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    model.load_weights(list(model.sanitize(weights).items()))  # strict: nothing missing or left over
    return model, json.loads((folder / "diffusion.json").read_text()), mx.load(str(folder / "reference.safetensors"))


def settings_of(expected: dict) -> DiffusionSettings:
    g = expected["generation"]
    return DiffusionSettings(
        steps=g["max_denoising_steps"],
        entropy_bound=g["entropy_bound"],
        t_min=g["t_min"],
        t_max=g["t_max"],
        stability_threshold=g["stability_threshold"],
        confidence_threshold=g["confidence_threshold"],
    )


def replay(expected: dict) -> ReplayedNoise:
    return ReplayedNoise([list(c) for c in expected["canvases"]], [list(s) for s in expected["samples"]])


@pytest.mark.parametrize("name", NAMES)
def test_denoiser_logits_match_transformers(name):
    model, expected, ref = load(name)
    cache = model.make_cache()
    model.encode(mx.array([expected["prompt_ids"]]), cache)
    canvas = mx.array([expected["forward_canvas"]])
    first = model.denoise(canvas, cache)
    second = model.denoise(canvas, cache, first)
    assert mx.abs(first[0] - ref["first_logits"]).max().item() < 1e-3
    assert mx.abs(second[0] - ref["second_logits"]).max().item() < 1e-3
    # Self-conditioning changes the prediction (so the check above tests it), and the
    # decoder leaves the prompt cache as it was.
    assert mx.abs(second - first).max().item() > 0.05
    assert mx.array_equal(model.denoise(canvas, cache), first)
    assert all(c.offset == len(expected["prompt_ids"]) for c in cache)


@pytest.mark.parametrize("name", NAMES)
def test_generation_matches_transformers_for_the_same_draws(name):
    model, expected, _ = load(name)
    noise = replay(expected)
    blocks = list(
        diffuse(
            model,
            expected["prompt_ids"],
            max_tokens=expected["generation"]["max_new_tokens"],
            settings=settings_of(expected),
            noise=noise,
            eos_ids=[1],
            pad_id=0,
        )
    )
    assert expected["prompt_ids"] + [t for b in blocks for t in b.raw] == expected["sequences"]
    assert [b.steps for b in blocks] == expected["steps_per_block"]
    assert not noise.canvases and not noise.samples  # every draw used, none more
    assert blocks[-1].finished and 1 not in blocks[-1].tokens and not any(b.finished for b in blocks[:-1])


def test_the_goldens_cover_early_stops_full_runs_and_an_end_in_a_later_block():
    _, tiny, _ = load("diffusion_gemma_tiny")
    _, published, _ = load("diffusion_gemma_published")
    assert min(tiny["steps_per_block"]) < tiny["generation"]["max_denoising_steps"]
    assert published["generation"]["stability_threshold"] == 2
    assert set(published["steps_per_block"]) == {published["generation"]["max_denoising_steps"]}
    for expected in (tiny, published):
        new = expected["sequences"][len(expected["prompt_ids"]) :]
        assert len(expected["steps_per_block"]) >= 2 and new.index(1) >= 8
    config = json.loads((GOLDEN / "diffusion_gemma_published" / "config.json").read_text())["text_config"]
    assert "per_layer_config" not in config and config["num_global_key_value_heads"] == 1


def test_seeded_generation_repeats_and_cancel_stops_between_steps():
    model, expected, _ = load("diffusion_gemma_tiny")
    settings = settings_of(expected)

    def run(seed, cancel=None):
        return [
            b.raw
            for b in diffuse(
                model,
                expected["prompt_ids"],
                max_tokens=16,
                settings=settings,
                noise=RandomNoise(seed),
                eos_ids=[1],
                pad_id=0,
                cancel=cancel,
            )
        ]

    assert run(3) == run(3)
    cancel = threading.Event()
    cancel.set()
    assert run(3, cancel) == []


def test_bad_settings_and_configs_get_one_clear_line():
    with pytest.raises(EngineError, match="steps"):
        DiffusionSettings(steps=0).checked()
    with pytest.raises(EngineError, match="t_min"):
        DiffusionSettings(t_min=0.9, t_max=0.5).checked()
    read = DiffusionSettings.from_generation_config(
        {"max_denoising_steps": 12, "sampler_config": {"entropy_bound": 0.3, "_cls_name": "EntropyBoundSamplerConfig"}}
    )
    assert (read.steps, read.entropy_bound, read.t_min) == (12, 0.3, 0.4)
    config = json.loads((GOLDEN / "diffusion_gemma_tiny" / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(UnsupportedModelError, match="both ways"):
        diffusion_gemma.ModelArgs.from_dict(config)


def test_a_quantized_embedding_table_self_conditions_like_its_dequantized_values():
    """mlx-community's 4-bit checkpoints quantize the embedding, which self-conditioning
    multiplies by the softmax: it must read the packed table, not multiply the packed ids."""
    import mlx.nn as nn

    model, expected, _ = load("diffusion_gemma_tiny")
    embed = model.model.embed_tokens
    table = embed.weight
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p == "model.embed_tokens")
    quantized = model.model.embed_tokens
    assert isinstance(quantized, nn.QuantizedEmbedding)
    dequantized = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, 32, 4)
    logits = mx.random.normal((8, table.shape[0]), key=mx.random.key(3))
    want = mx.softmax(logits, axis=-1) @ dequantized * (model.args.hidden_size**0.5)
    assert mx.abs(model.soft_embedding(logits) - want).max().item() < 1e-4
    cache = model.make_cache()
    model.encode(mx.array([expected["prompt_ids"]]), cache)
    first = model.denoise(mx.array([expected["forward_canvas"]]), cache)
    assert model.denoise(mx.array([expected["forward_canvas"]]), cache, first).shape == first.shape
