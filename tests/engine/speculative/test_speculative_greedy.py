"""Speculative greedy decoding reproduces plain greedy decoding token for token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from spec_models import make_llama, plain_greedy, plain_logprobs

from engine.api import SamplingParams
from engine.decode.drafters import DraftModelDrafter, NgramDrafter, check_draft_compatible
from engine.decode.sampling import make_logits_processors
from engine.decode.speculative import speculative_decode, speculative_step
from engine.decode.stats import StatsCounter
from engine.errors import EngineError
from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
N = 40


@pytest.fixture(scope="module")
def target():
    return make_llama(0)


@pytest.fixture(scope="module")
def other():
    return make_llama(1)


def run(model, drafter, prompt=PROMPT, n=N, **kw):
    stats = StatsCounter()
    cache = kw.pop("cache", None) or make_prompt_cache(model)
    out = [t for t, _ in speculative_step(prompt, model, cache, drafter, max_tokens=n, stats=stats, **kw)]
    return out, stats, cache


def test_different_draft_model_matches_plain_greedy(target, other):
    want = plain_greedy(target, PROMPT, N)
    got, stats, cache = run(target, DraftModelDrafter(other), num_draft_tokens=3)
    assert got == want
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    assert cache[0].offset == len(PROMPT) + N - 1  # every id but the last generated one


def test_self_draft_accepts_everything(target):
    want = plain_greedy(target, PROMPT, N)
    got, stats, _ = run(target, DraftModelDrafter(target), num_draft_tokens=4)
    assert got == want
    assert stats.draft_tokens >= N - 10 and stats.accepted_draft_tokens == stats.draft_tokens


def test_ngram_on_repetitive_prompt(target):
    prompt = [7, 8, 9, 10, 11, 12] * 4 + [7, 8, 9]
    want = plain_greedy(target, prompt, N)
    got, stats, _ = run(target, NgramDrafter(n=2, max_draft=4), prompt=prompt)
    assert got == want
    assert stats.draft_tokens > 0


def test_ngram_lookup_finds_latest_match():
    d = NgramDrafter(n=2, max_draft=3)
    history = [1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2]
    assert d.propose(history, 3, None)[0] == [5, 6, 7]  # the later "1 2" wins
    assert d.propose(history, 1, None)[0] == [5]
    assert d.propose([4, 4, 1, 2], 3, None)[0] == []


@pytest.mark.parametrize("drafting", ["draft model", "n-gram"])
def test_logprobs_match_plain(target, other, drafting):
    drafter = DraftModelDrafter(other) if drafting == "draft model" else NgramDrafter(n=1, max_draft=3)
    got = list(speculative_decode(target, make_prompt_cache(target), drafter, PROMPT, max_tokens=12, logprobs=True))
    tokens = [t for t, _ in got]
    assert tokens == plain_greedy(target, PROMPT, 12)
    np.testing.assert_allclose([lp for _, lp in got], plain_logprobs(target, PROMPT, tokens), atol=1e-4)


@pytest.mark.parametrize("drafting", ["draft model", "n-gram"])
def test_repetition_penalty_path_matches_plain_processed_greedy(target, other, drafting):
    params = SamplingParams(repetition_penalty=1.5, repetition_context=16)
    procs = make_logits_processors(params)
    # Reference: one token at a time with the same processor.
    cache = make_prompt_cache(target)
    ctx = list(PROMPT)
    logits = target(mx.array([PROMPT]), cache=cache)[0, -1]
    want = []
    for _ in range(20):
        processed = procs[0](mx.array(ctx), logits[None])[0]
        token = int(mx.argmax(processed).item())
        want.append(token)
        ctx.append(token)
        logits = target(mx.array([[token]]), cache=cache)[0, -1]
    # n-gram lookup of 1 id finds drafts now and then, and decodes plainly in between.
    drafter = DraftModelDrafter(other) if drafting == "draft model" else NgramDrafter(n=1, max_draft=3)
    got, stats, _ = run(target, drafter, n=20, sampling=params, logits_processors=procs)
    assert got == want and stats.draft_tokens > 0


def test_after_prefix_reuse_with_trimmed_caches(target, other):
    """Turn 1 leaves both caches holding an old continuation; turn 2 trims back to the shared
    prefix and continues with new ids, as the chat session does."""
    cache = make_prompt_cache(target)
    drafter = DraftModelDrafter(other)
    first, _, _ = run(target, drafter, n=15, cache=cache)
    shared = len(PROMPT) - 3
    trim_prompt_cache(cache, cache[0].offset - shared)
    drafter.rewind(shared)
    new_prompt = PROMPT[:shared] + [90, 91, 92, 4]
    got, stats, _ = run(target, drafter, prompt=new_prompt[shared:], cache=cache, history=new_prompt)
    assert got == plain_greedy(target, new_prompt, N)
    assert stats.draft_tokens > 0


def test_early_stop_leaves_cache_like_plain_decoding(target):
    cache = make_prompt_cache(target)
    gen = speculative_step(PROMPT, target, cache, DraftModelDrafter(target), max_tokens=30, num_draft_tokens=4)
    taken = [next(gen)[0] for _ in range(6)]  # stop in the middle of an accepted run
    gen.close()
    assert cache[0].offset == len(PROMPT) + len(taken) - 1
    rest = [
        t
        for t, _ in speculative_step([taken[-1]], target, cache, NgramDrafter(2), max_tokens=10, history=PROMPT + taken)
    ]
    assert taken + rest == plain_greedy(target, PROMPT, 16)


def test_sliding_window_falls_back_to_plain_decoding():
    model = make_llama(2, model_type="mistral", sliding_window=16)
    draft = make_llama(3, model_type="mistral", sliding_window=16)
    want = plain_greedy(model, PROMPT, 30)
    got, stats, cache = run(model, DraftModelDrafter(draft), n=30, num_draft_tokens=3)
    assert got == want
    assert type(cache[0]).__name__ == "RotatingKVCache"
    assert 0 < stats.draft_tokens < 30  # drafted while the window had room, then stopped
    # n-gram lookup decodes a step ahead between matches: it stops that at the window too.
    got, _, _ = run(model, NgramDrafter(n=1, max_draft=3), n=30)
    assert got == want


def test_early_stop_between_ngram_matches_leaves_cache_like_plain_decoding(target):
    cache = make_prompt_cache(target)
    gen = speculative_step(PROMPT, target, cache, NgramDrafter(n=6), max_tokens=30)  # never matches here
    taken = [next(gen)[0] for _ in range(5)]
    gen.close()
    assert cache[0].offset == len(PROMPT) + len(taken) - 1
    rest = [
        t
        for t, _ in speculative_step([taken[-1]], target, cache, NgramDrafter(2), max_tokens=10, history=PROMPT + taken)
    ]
    assert taken + rest == plain_greedy(target, PROMPT, 15)


def test_vocabulary_check():
    base = {f"t{i}": i for i in range(50)}
    check_draft_compatible(base, dict(base))
    check_draft_compatible(base, {**base, "<extra>": 50})  # appended special token
    swapped = {**base, "t3": 4, "t4": 3}
    with pytest.raises(EngineError, match="vocabulary does not match.*id 3 is 't3' for the target but 't4'"):
        check_draft_compatible(base, swapped)
    with pytest.raises(EngineError, match="same family"):
        check_draft_compatible(base, {**base, "<new>": 7, "t7": 51})


FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen2": {"attention_bias": True},
    "qwen3": {"head_dim": 8},
    "phi3": {},
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 64},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 64},
}


@pytest.mark.parametrize("model_type", list(FAMILY_CONFIGS))
def test_every_family_matches_plain_greedy(model_type):
    import importlib

    from engine.models import SUPPORTED

    module = f"engine.models.{SUPPORTED[model_type]}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        pytest.skip(f"the {model_type} family is not in this checkout")
    extra = {"model_type": model_type, "tie_word_embeddings": False, **FAMILY_CONFIGS[model_type]}
    model = make_llama(20, **extra)
    draft = make_llama(21, **extra)
    want = plain_greedy(model, PROMPT, 24)
    got, stats, _ = run(model, DraftModelDrafter(draft), n=24, num_draft_tokens=3)
    assert got == want and stats.draft_tokens > 0
    got, _, _ = run(model, DraftModelDrafter(model), n=24, num_draft_tokens=3)
    assert got == want
