"""DiffusionGemma reads images, against transformers 5.23
(tests/golden/make_diffusion_gemma_media_goldens.py): the prompt Gemma4Processor expands,
Gemma 4's vision tower read from inside the prompt encoder, the encoder letting one
image's tokens see each other both ways on every layer, and whole block-diffusion
generations fed the random draws transformers made.

The tiny checkpoint is bf16 on disk and loaded in float32, as the references ran; the
photo is ../shared/data/images/chelsea.png."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput, SamplingParams
from engine.decode.diffusion import DiffusionSettings, ReplayedNoise, diffuse
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

ROOT = Path(__file__).resolve().parents[3]
FOLDER = ROOT / "tests" / "golden" / "diffusion_gemma" / "diffusion_gemma_image"
EXPECTED = json.loads((FOLDER / "diffusion.json").read_text())


@pytest.fixture(scope="module")
def host() -> ModelHost:
    from engine.runtime import loading as loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        h = ModelHost()
        h.load(str(FOLDER))
    return h


def image(shared_data: Path) -> list[MediaInput]:
    return [MediaInput("image", str(shared_data / "images" / EXPECTED["image_file"]))]


def prompt_and_inputs(host: ModelHost, shared_data: Path):
    chat = host.session("golden")
    messages, items = split_media(EXPECTED["messages"], image(shared_data))
    media = chat.media_prompt(chat.render(messages), items)
    return media, chat._prompt_inputs(media, 0)


def test_the_prompt_and_the_image_features_match_transformers(host, shared_data):
    assert host.info.vision
    media, inputs = prompt_and_inputs(host, shared_data)
    assert media.ids == EXPECTED["prompt_ids"]
    (span,) = media.spans
    assert span.end - span.start == EXPECTED["image_soft_tokens"]
    features = np.array(host.towers.features(span.item))
    np.testing.assert_allclose(features, np.array(EXPECTED["image_features"]), atol=1e-4, rtol=0)
    assert inputs.blocks == [(span.start, span.end)]  # the image's run, both ways


def test_the_denoiser_after_an_image_matches_transformers(host, shared_data):
    model = host.model
    media, inputs = prompt_and_inputs(host, shared_data)
    cache = model.make_cache()
    model.encode(mx.array([media.ids]), cache, inputs.embeddings[None], inputs.blocks)
    logits = model.denoise(mx.array([EXPECTED["forward_canvas"]]), cache)[0]
    reference = mx.load(str(FOLDER / "reference.safetensors"))["first_logits"]
    assert mx.abs(logits - reference).max().item() < 1e-3
    # Attending causally within the image instead gives other logits (the reference tells them apart).
    causal = model.make_cache()
    model.encode(mx.array([media.ids]), causal, inputs.embeddings[None], None)
    assert mx.abs(model.denoise(mx.array([EXPECTED["forward_canvas"]]), causal)[0] - reference).max().item() > 0.05


def test_generation_with_an_image_matches_transformers_for_the_same_draws(host, shared_data):
    media, inputs = prompt_and_inputs(host, shared_data)
    g = EXPECTED["generation"]
    settings = DiffusionSettings(
        steps=g["max_denoising_steps"],
        entropy_bound=g["entropy_bound"],
        t_min=g["t_min"],
        t_max=g["t_max"],
        stability_threshold=g["stability_threshold"],
        confidence_threshold=g["confidence_threshold"],
    )
    noise = ReplayedNoise([list(c) for c in EXPECTED["canvases"]], [list(s) for s in EXPECTED["samples"]])
    blocks = list(
        diffuse(
            host.model,
            media.ids,
            max_tokens=g["max_new_tokens"],
            settings=settings,
            noise=noise,
            eos_ids=[1],
            pad_id=0,
            inputs=inputs,
        )
    )
    assert media.ids + [t for b in blocks for t in b.raw] == EXPECTED["sequences"]
    assert [b.steps for b in blocks] == EXPECTED["steps_per_block"]
    assert not noise.canvases and not noise.samples


def test_a_follow_up_turn_keeps_the_image_in_the_cache(host, shared_data):
    """The image is encoded once; the next turn prefills only what follows the cached prefix
    and writes what a fresh conversation writes."""
    params = GenerationParams(max_tokens=16, sampling=SamplingParams(seed=4))
    first = host.generate("turns", EXPECTED["messages"], params, media=image(shared_data))
    calls = host.towers.encode_calls
    follow = EXPECTED["messages"] + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the colours?"},
    ]
    second = host.generate("turns", follow, params, media=image(shared_data))
    assert host.towers.encode_calls == calls
    assert second.stats.cached_tokens >= len(EXPECTED["prompt_ids"])
    fresh = host.generate("fresh", follow, params, media=image(shared_data))
    assert fresh.stats.cached_tokens == 0
    assert second.token_ids == fresh.token_ids and second.denoising_steps == fresh.denoising_steps


def test_generate_cli_takes_an_image(shared_data):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(FOLDER), "--chat", "--json"]
        + ["--prompt", "What is in this picture?", "--image", str(shared_data / "images" / "chelsea.png")]
        + ["--max-tokens", "8", "--seed", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(EXPECTED["prompt_ids"]) and out["denoising_steps"] >= 1
