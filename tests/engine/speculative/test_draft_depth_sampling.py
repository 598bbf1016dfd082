"""Sampled speculative output keeps the target's distribution while the draft depth changes
from round to round, plain tokens between rounds included (chi-square, as in
test_speculative_sampling.py, whose functions this reuses)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from spec_models import make_llama
from test_draft_depth import Scripted
from test_speculative_sampling import SAMPLES, VOCAB, check, chi2, chi2_critical, exact_pairs, target_dist

from engine.api import SamplingParams
from engine.decode.drafters import DraftModelDrafter
from engine.decode.prefill import prefill
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param([2, 0, 1], marks=pytest.mark.long), [0, 2]])
def test_sampling_with_a_changing_depth_keeps_target_distribution(script):
    target = make_llama(10, vocab=VOCAB, layers=1, sharpen=6.0)
    draft = make_llama(11, vocab=VOCAB, layers=1, sharpen=6.0)
    drafter = DraftModelDrafter(draft)
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    cache = make_prompt_cache(target)
    prefill(target, mx.array(prompt[:-1]), cache, chunk=64)
    counts = np.zeros((VOCAB, VOCAB))
    stats = StatsCounter()
    for i in range(SAMPLES):
        run = SamplingParams(**{**params.__dict__, "seed": 2000 + i})
        depth = Scripted(script)  # each run changes depth after its first round or token
        out = [
            t
            for t, _ in speculative_step(
                prompt[-1:],
                target,
                cache,
                drafter,
                max_tokens=4,
                sampling=run,
                stats=stats,
                history=prompt,
                depth=depth,
            )
        ]
        counts[out[0], out[1]] += 1
        trim_prompt_cache(cache, cache[0].offset - (len(prompt) - 1))
        drafter.rewind(len(prompt) - 1)
    assert 0.15 < stats.acceptance_rate < 0.9  # both acceptance and rejection paths are exercised
    p = target_dist(target, prompt, params)
    q = target_dist(draft, prompt, params)
    accept = np.minimum(p, q).sum()
    wrong = np.minimum(p, q) + (1 - accept) * p  # "on rejection, sample from p"
    joint = exact_pairs(target, prompt, params)
    if script[0] == 0:
        # The first token is plain, the second from a round whose drafts were asked for after
        # it (carried out of the plain run): the fit alone is checked; the rule's power shows
        # in the other scripts, which verify from the first token on.
        stat, df = chi2(counts.ravel(), joint.ravel())
        assert stat < chi2_critical(df), f"off the target distribution: {stat:.1f} on {df} df"
    else:
        check(counts, joint, wrong)
