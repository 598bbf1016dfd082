"""Speculative decoding on hybrid models (recurrent layers beside attention): rejected drafts
are rolled back exactly, so greedy output is plain greedy output token for token.

A recurrent state cannot be cut back; the layers keep their state after each recent
token (engine/models/recurrent_cache.py) and a trim restores the one before the rejected
drafts. Restoring a wrong one (or only moving the offset) changes the following tokens,
which these comparisons catch: after every run the cache must also continue exactly as
plain decoding's does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from spec_models import plain_greedy, plain_logprobs

from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hybrid_families import build  # noqa: E402

N = 24


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_5")


@pytest.fixture(scope="module")
def lfm():
    return build("lfm2")


def run(model, drafter, prompt, n=N, **kw):
    stats = StatsCounter()
    cache = model.make_cache()
    got = list(speculative_step(prompt, model, cache, drafter, max_tokens=n, stats=stats, logprobs=True, **kw))
    return [t for t, _ in got], [lp for _, lp in got], stats, cache


def continues_like_plain(model, cache, prompt, tokens):
    """The cache holds every id but the last generated one, in the state plain decoding has."""
    assert all(c.offset == len(prompt) + len(tokens) - 1 for c in cache)
    reference = model.make_cache()
    model(mx.array([prompt + tokens[:-1]]), cache=reference)
    a = model(mx.array([tokens[-1:]]), cache=cache)[0, -1]
    b = model(mx.array([tokens[-1:]]), cache=reference)[0, -1]
    assert mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.parametrize("target_name, draft_name", [("qwen", "lfm"), ("lfm", "qwen"), ("qwen", "qwen")])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_model_greedy_equals_plain(request, target_name, draft_name, k):
    target, expected = request.getfixturevalue(target_name)
    draft, _ = request.getfixturevalue(draft_name)
    prompt = expected["prompt_ids"][:40]
    want = plain_greedy(target, prompt, N)
    got, lps, stats, cache = run(target, DraftModelDrafter(draft, draft.make_cache()), prompt, num_draft_tokens=k)
    assert got == want
    np.testing.assert_allclose(lps, plain_logprobs(target, prompt, got), atol=1e-4)
    assert stats.draft_tokens > 0
    if target_name == draft_name:  # self-drafting accepts every draft
        assert stats.accepted_draft_tokens == stats.draft_tokens
    else:  # unrelated random models: most drafts are rejected and rolled back
        assert stats.accepted_draft_tokens < stats.draft_tokens
    continues_like_plain(target, cache, prompt, got)


@pytest.mark.parametrize("name", ["qwen", "lfm"])
def test_ngram_greedy_equals_plain(request, name):
    model, expected = request.getfixturevalue(name)
    # Repeats give the lookup drafts, most of them wrong for a random model.
    prompt = expected["prompt_ids"][:12] * 3
    want = plain_greedy(model, prompt, N)
    got, lps, stats, cache = run(model, NgramDrafter(n=2, max_draft=4), prompt)
    assert got == want
    np.testing.assert_allclose(lps, plain_logprobs(model, prompt, got), atol=1e-4)
    assert stats.draft_tokens > 0
    continues_like_plain(model, cache, prompt, got)


def test_stopping_early_leaves_the_cache_consistent(qwen):
    model, expected = qwen
    prompt = expected["prompt_ids"][:30]
    cache = model.make_cache()
    steps = speculative_step(
        prompt, model, cache, DraftModelDrafter(model, model.make_cache()), max_tokens=N, num_draft_tokens=4
    )
    tokens = [next(steps)[0] for _ in range(6)]  # stop in the middle of an accepted run
    steps.close()
    assert tokens == plain_greedy(model, prompt, 6)
    continues_like_plain(model, cache, prompt, tokens)
