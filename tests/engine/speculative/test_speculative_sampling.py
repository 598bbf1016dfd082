"""Sampled speculative output keeps the target's distribution (rejection sampling is exact).

A tiny model with an 8-token vocabulary; thousands of seeded runs of the first two tokens;
a chi-square test of the observed pairs against the exact target distribution computed from
the model's logits. Each test also checks that it has the power to see a wrong rule: the same
samples are clearly inconsistent with what a plausible mistake (resampling from p instead of
the residual after a rejection) would produce.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from spec_models import make_llama

from engine.api import SamplingParams
from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.prefill import prefill
from engine.decode.sampling import filter_logits
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache

VOCAB = 8
SAMPLES = 1200


def target_dist(model, ids: list[int], params: SamplingParams) -> np.ndarray:
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return np.array(mx.softmax(filter_logits(logits, params), axis=-1), dtype=np.float64)


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is p = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic over cells, pooling cells with expected counts under 5."""
    n = observed.sum()
    exp = expected_p * n
    big = exp >= 5
    obs_cells = list(observed[big]) + [observed[~big].sum()]
    exp_cells = list(exp[big]) + [exp[~big].sum()]
    pairs = [(o, e) for o, e in zip(obs_cells, exp_cells) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in pairs)
    return float(stat), len(pairs) - 1


def sample_pairs(model, drafter, prompt, params, k, max_tokens=2):
    """Counts of the first two tokens over SAMPLES seeded runs of ``max_tokens`` tokens (more
    than 2 lets a round draft up to k = max_tokens - 1)."""
    cache = make_prompt_cache(model)
    prefill(model, mx.array(prompt[:-1]), cache, chunk=64)
    counts = np.zeros((VOCAB, VOCAB))
    stats = StatsCounter()
    for i in range(SAMPLES):
        run_params = SamplingParams(**{**params.__dict__, "seed": 1000 + i})
        out = [
            t
            for t, _ in speculative_step(
                prompt[-1:],
                model,
                cache,
                drafter,
                max_tokens=max_tokens,
                sampling=run_params,
                num_draft_tokens=k,
                stats=stats,
                history=prompt,
            )
        ]
        counts[out[0], out[1]] += 1
        trim_prompt_cache(cache, cache[0].offset - (len(prompt) - 1))
        drafter.rewind(len(prompt) - 1)
    return counts, stats


def exact_pairs(model, prompt, params) -> np.ndarray:
    p1 = target_dist(model, prompt, params)
    return np.stack([p1[a] * target_dist(model, prompt + [a], params) for a in range(VOCAB)])


def check(counts, joint, wrong_first):
    stat, df = chi2(counts.ravel(), joint.ravel())
    assert stat < chi2_critical(df), f"speculative samples are off the target distribution: {stat:.1f} on {df} df"
    bad_stat, bad_df = chi2(counts.sum(axis=1), wrong_first)
    assert bad_stat > chi2_critical(bad_df), "the test could not tell a wrong rejection rule apart"


@pytest.mark.slow
def test_draft_model_sampling_keeps_target_distribution():
    target = make_llama(10, vocab=VOCAB, layers=1, sharpen=6.0)
    draft = make_llama(11, vocab=VOCAB, layers=1, sharpen=6.0)
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    counts, stats = sample_pairs(target, DraftModelDrafter(draft), prompt, params, k=1)
    # The draft disagrees often enough that both acceptance and rejection paths are exercised.
    assert 0.15 < stats.acceptance_rate < 0.9
    p = target_dist(target, prompt, params)
    q = target_dist(draft, prompt, params)
    accept = np.minimum(p, q).sum()
    wrong = np.minimum(p, q) + (1 - accept) * p  # "on rejection, sample from p"
    check(counts, exact_pairs(target, prompt, params), wrong)


@pytest.mark.slow
def test_ngram_sampling_with_filters_keeps_target_distribution():
    target = make_llama(12, vocab=VOCAB, layers=1, sharpen=4.0)
    prompt = [1, 2, 4, 6, 1, 2]  # "1 2" occurred before: the n-gram drafter proposes 4 (p about 0.46)
    params = SamplingParams(temperature=0.8, top_k=6)
    counts, stats = sample_pairs(target, NgramDrafter(n=2, max_draft=2), prompt, params, k=1)
    assert stats.draft_tokens == SAMPLES and 0 < stats.accepted_draft_tokens < SAMPLES
    p = target_dist(target, prompt, params)
    wrong = (1 - p[4]) * p  # "accept with p(d), else sample from p"
    wrong[4] += p[4]
    check(counts, exact_pairs(target, prompt, params), wrong)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("k", [2, 4])
def test_draft_model_sampling_with_several_drafts_a_round_keeps_target_distribution(k):
    """k drafts a round: the second token comes from an accepted second draft, from the
    residual at the second position after its rejection, or from a fresh round after a
    first rejection. Taking the residual from the row before the rejected one fails it (a
    statistic of about 61 on 13 degrees of freedom, against a critical 41, at 2 and 4 drafts)."""
    target = make_llama(10, vocab=VOCAB, layers=1, sharpen=6.0)
    draft = make_llama(11, vocab=VOCAB, layers=1, sharpen=6.0)
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    counts, stats = sample_pairs(target, DraftModelDrafter(draft), prompt, params, k=k, max_tokens=k + 1)
    assert stats.draft_tokens >= SAMPLES * 2 and 0.15 < stats.acceptance_rate < 0.9
    p = target_dist(target, prompt, params)
    q = target_dist(draft, prompt, params)
    accept = np.minimum(p, q).sum()
    check(counts, exact_pairs(target, prompt, params), np.minimum(p, q) + (1 - accept) * p)
