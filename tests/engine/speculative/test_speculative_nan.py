"""NaN logits end a speculative reply with the damaged-weights line, whether they show up in
a verification pass or in the plain single-token steps taken between drafts."""

from __future__ import annotations

import mlx.core as mx
import pytest
from spec_models import make_llama, plain_greedy

from engine.decode.drafters import NgramDrafter
from engine.decode.guards import DAMAGED_WEIGHTS, NonFiniteLogits
from engine.decode.speculative import speculative_step
from engine.models.kv_cache import make_prompt_cache

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]  # no id repeats: n-gram lookup finds nothing


@pytest.mark.parametrize("logprobs", [False, True])
def test_nan_in_a_plain_step_between_drafts_ends_the_reply(logprobs):
    model = make_llama(0)
    want = plain_greedy(model, PROMPT, 8)
    bad = next(t for t in want[1:] if t not in PROMPT and t != want[0])
    # Only the embedding of a token the reply reaches is damaged: the prompt's passes are
    # finite, and the first NaN logits come from the plain step that feeds ``bad``.
    table = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = mx.where(mx.arange(table.shape[0])[:, None] == bad, mx.nan, table)
    got = []
    with pytest.raises(NonFiniteLogits, match=DAMAGED_WEIGHTS):
        for token, _ in speculative_step(
            PROMPT,
            model,
            make_prompt_cache(model),
            NgramDrafter(n=3, max_draft=4),
            max_tokens=8,
            logprobs=logprobs,
            num_draft_tokens=4,
        ):
            got.append(token)
    assert got == want[: want.index(bad) + 1]  # every token up to the damage, none after
