"""Sampled speculative decoding on hybrid models keeps the target's distribution with 2 and 4
drafts per round: rejection sampling over several drafts, the residual taken from the row
of the first rejection, and the recurrent state rolled back to the accepted drafts.

Seeded runs of k + 1 tokens from a tiny Qwen3.5-layout target (a DeltaNet layer and a
gated-attention layer, 8-token vocabulary), drafted by another model of that layout (its
first draft is accepted about 64% of the time); the first two tokens are counted and
checked by chi-square against the exact joint distribution (as in
test_speculative_sampling.py, whose helpers these are)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from test_speculative_sampling import SAMPLES, VOCAB, check, exact_pairs, sample_pairs, target_dist

from engine.api import SamplingParams
from engine.decode.drafters import DraftModelDrafter
from engine.models import get_family


def tiny(model_type: str, seed: int, sharpen: float, **extra):
    config = {
        "model_type": model_type,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        **extra,
    }
    family = get_family(model_type)
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    model.lm_head.weight = model.lm_head.weight * sharpen  # peaked, not near-uniform, distributions
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("k", [2, 4])
def test_hybrid_draft_model_sampling_keeps_target_distribution(k):
    layout = dict(
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention"],
    )
    target = tiny("qwen3_5", 20, 2.0, **layout)
    draft = tiny("qwen3_5", 22, 6.0, **layout)
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    drafter = DraftModelDrafter(draft, draft.make_cache())
    counts, stats = sample_pairs(target, drafter, prompt, params, k=k, max_tokens=k + 1)
    assert stats.draft_tokens > 1.5 * SAMPLES  # several drafts per round
    assert 0.15 < stats.acceptance_rate < 0.9  # both acceptance and rejection paths taken
    p = target_dist(target, prompt, params)
    q = target_dist(draft, prompt, params)
    wrong = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p  # "on rejection, sample from p"
    check(counts, exact_pairs(target, prompt, params), wrong)
