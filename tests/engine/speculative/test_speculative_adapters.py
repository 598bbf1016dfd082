"""Speculative decoding over a model with an active adapter, drafted by the same base without it."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from spec_models import plain_greedy

from engine.decode.drafters import DraftModelDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models import get_family
from engine.models import lora as adapters
from engine.models.kv_cache import make_prompt_cache

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "adapters"


def load_base():
    config = json.loads((GOLDEN / "base" / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize(dict(mx.load(str(GOLDEN / "base" / "model.safetensors")))).items()))
    return model


def test_adapted_target_with_plain_draft_matches_plain_greedy():
    target, draft = load_base(), load_base()
    adapters.mount(target, GOLDEN / "peft_vo_mlp", name="vo")
    adapters.activate(target, {"vo": 1.0})
    prompt = [1, 7, 42, 99, 3, 64]
    want = plain_greedy(target, prompt, 30)
    assert want != plain_greedy(draft, prompt, 30)  # the adapter changes what is generated
    stats = StatsCounter()
    got = [
        t
        for t, _ in speculative_step(
            prompt,
            target,
            make_prompt_cache(target),
            DraftModelDrafter(draft),
            max_tokens=30,
            num_draft_tokens=3,
            stats=stats,
        )
    ]
    assert got == want and stats.draft_tokens > 0
