"""Speculative decoding waits for the device once per draft-and-verify round, not per draft."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from spec_models import make_llama, plain_greedy

from engine.api import SamplingParams
from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.kv_cache import make_prompt_cache

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]


@pytest.fixture(scope="module")
def target():
    return make_llama(0)


@pytest.fixture(scope="module")
def other():
    return make_llama(1)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every way the loop can wait for the device and read values back."""
    counts = {"eval": 0, "item": 0, "tolist": 0}
    real_eval, real_item, real_tolist = mx.eval, mx.array.item, mx.array.tolist

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mx, "eval", counting("eval", real_eval))
    monkeypatch.setattr(mx.array, "item", counting("item", real_item))
    monkeypatch.setattr(mx.array, "tolist", counting("tolist", real_tolist))
    return counts


def decode(model, drafter, n, **kw):
    stats = StatsCounter()
    out = [
        t
        for t, _ in speculative_step(PROMPT, model, make_prompt_cache(model), drafter, max_tokens=n, stats=stats, **kw)
    ]
    return out, stats


@pytest.mark.parametrize("k", [2, 4])
def test_self_draft_reads_once_per_round(target, host_reads, k):
    want = plain_greedy(target, PROMPT, 30)  # counted too: one item() per token
    host_reads.update(eval=0, item=0, tolist=0)
    got, stats = decode(target, DraftModelDrafter(target), 30, num_draft_tokens=k)
    assert got == want and stats.accepted_draft_tokens == stats.draft_tokens
    rounds = math.ceil(30 / (k + 1))
    # Prefill: one evaluation for the target's prompt, one for the draft model's; then one
    # read per round. Reading each draft (the old loop) would be k + 1 per round.
    assert host_reads["item"] == 0
    assert host_reads["tolist"] == rounds
    assert host_reads["eval"] <= 2


def test_draft_model_with_rejections_and_logprobs(target, other, host_reads):
    got, stats = decode(target, DraftModelDrafter(other), 30, num_draft_tokens=3, logprobs=True)
    assert got == plain_greedy(target, PROMPT, 30)
    host_reads.update(eval=0, item=0, tolist=0)
    got, stats = decode(target, DraftModelDrafter(other), 30, num_draft_tokens=3, logprobs=True)
    rounds = 30 - stats.accepted_draft_tokens  # each round emits its accepted drafts plus one
    assert host_reads["item"] == 0 and host_reads["eval"] <= 2
    assert host_reads["tolist"] <= rounds


def test_sampled_rounds_read_once(target, other, host_reads):
    params = SamplingParams(temperature=0.8, seed=3)
    got, stats = decode(target, DraftModelDrafter(other), 24, num_draft_tokens=3, sampling=params)
    rounds = 24 - stats.accepted_draft_tokens
    assert len(got) == 24 and stats.draft_tokens > 0
    assert host_reads["item"] == 0 and host_reads["eval"] <= 2
    assert host_reads["tolist"] <= rounds


def test_ngram_reads_once_per_round(target, host_reads):
    got, stats = decode(target, NgramDrafter(n=1, max_draft=4), 20)
    assert got == plain_greedy(target, PROMPT, 20)
    host_reads.update(eval=0, item=0, tolist=0)
    got, stats = decode(target, NgramDrafter(n=1, max_draft=4), 20)
    # A round that verifies drafts reads once; a token decoded while the lookup finds
    # nothing is read on its own, as in the plain loop.
    assert host_reads["eval"] <= 1
    assert host_reads["item"] + host_reads["tolist"] <= 20 - stats.accepted_draft_tokens
    assert stats.accepted_draft_tokens > 0


def test_ngram_misses_decode_a_step_ahead(target, monkeypatch):
    """While the lookup finds nothing, the step after token n is queued before token n is
    read (the device is never idle waiting for Python), and stopping leaves the cache
    holding every id before the last token, as after plain decoding."""
    want = plain_greedy(target, PROMPT, 12)
    cache = make_prompt_cache(target)
    offsets = []
    real_tolist = mx.array.tolist

    def tolist(a):  # each plain token (with its NaN check) is one read
        offsets.append(cache[0].offset)
        return real_tolist(a)

    monkeypatch.setattr(mx.array, "tolist", tolist)
    stats = StatsCounter()
    got = [
        t
        for t, _ in speculative_step(PROMPT, target, cache, NgramDrafter(n=8, max_draft=4), max_tokens=12, stats=stats)
    ]
    assert got == want and stats.draft_tokens == 0
    # At the read of token i the caches hold the prompt, tokens 0..i-1 and, queued, token i.
    assert offsets == [len(PROMPT) + i + 1 for i in range(11)] + [len(PROMPT) + 11]
    assert cache[0].offset == len(PROMPT) + 11


def test_compiled_steps_match_plain_greedy(target, other):
    """The compiled one-token path (what a GPU uses by default) for the draft model and for
    the target's single-token rounds gives the same tokens."""
    want = plain_greedy(target, PROMPT, 16)
    got, stats = decode(target, DraftModelDrafter(other), 16, num_draft_tokens=3, compiled=True)
    assert got == want and stats.draft_tokens > 0
    got, _ = decode(target, NgramDrafter(n=3, max_draft=2), 16, compiled=True)
    assert got == want
