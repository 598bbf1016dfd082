"""Every family against transformers: same greedy ids, log-probs within 2e-3."""

from __future__ import annotations

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, load_golden

TOLERANCE = 2e-3


def greedy(model, prompt: list[int], n: int):
    """Prefill, then decode one token at a time through the model's own caches."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    ids, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        logprobs.append(float(lp[0, token].item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return ids, logprobs


def test_every_family_has_a_golden():
    for name in ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3"):
        assert name in FAMILIES


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(name):
    model, expected = load_golden(name)
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert ids == expected["greedy_ids"], name
    worst = max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"]))
    assert worst < TOLERANCE, f"{name}: log-prob differs by {worst}"
