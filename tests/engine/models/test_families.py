"""Every family against transformers: same greedy ids, log-probs within 2e-3."""

from __future__ import annotations

import pytest
from model_goldens import FAMILIES, greedy, load_golden

TOLERANCE = 2e-3


def test_every_family_has_a_golden():
    for name in (
        "llama",
        "llama3_rope",
        "llama_dynamic",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma2",
        "gemma3_text",
        "phi3",
    ):
        assert name in FAMILIES


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(name):
    model, expected = load_golden(name)
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert ids == expected["greedy_ids"], name
    worst = max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"]))
    assert worst < TOLERANCE, f"{name}: log-prob differs by {worst}"
