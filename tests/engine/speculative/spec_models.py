"""Tiny random Llamas for the speculative decoding tests, and a plain greedy reference loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from engine.decode.mtp_drafter import MTPDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models import get_family
from engine.models.kv_cache import make_prompt_cache


def make_llama(seed: int, vocab: int = 96, hidden: int = 32, layers: int = 2, sharpen: float = 1.0, **extra):
    family = get_family(extra.get("model_type", "llama"))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        **extra,
    }
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    if sharpen != 1.0:  # spread the logits so distributions are peaked, not near-uniform
        model.lm_head.weight = model.lm_head.weight * sharpen
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def mtp_hub_weights(model, seed: int = 7) -> dict[str, mx.array]:
    """Random weights for a Qwen3.5-family model's MTP layer, named and laid out as the Hub
    stores them (``mtp.*``; the (1 + w) norms as w), float32."""
    from mlx.utils import tree_flatten

    from engine.models.qwen3_5_mtp import MTPHead

    head = MTPHead(model.args, model.model.layer_class)
    rng = np.random.default_rng(seed)
    return {
        "mtp." + key: mx.array(
            ((0.1 if value.ndim == 1 else 0.15) * rng.standard_normal(value.shape)).astype(np.float32)
        )
        for key, value in tree_flatten(head.parameters())
    }


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """One token per forward pass, argmax each time: the reference speculative greedy must match."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def plain_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    logits = model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [float(lp[i, t].item()) for i, t in enumerate(tokens)]


def assert_mtp_run_is_plain(model, prompt: list[int], want: list[int], got: list, stats) -> None:
    """An MTP-drafted run gave plain greedy's tokens and log-probs, verified its drafts
    (random MTP weights: few are accepted) and left no listener on the model."""
    assert [t for t, _ in got] == want
    np.testing.assert_allclose([lp for _, lp in got], plain_logprobs(model, prompt, want), atol=1e-4)
    assert stats.draft_tokens > 0
    assert 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    assert model.hidden_listener is None


def check_mtp_drafting(
    model, prompt: list[int], n: int, k: int, during: Callable[[], None] | None = None, **options: Any
) -> None:
    """Decode ``n`` tokens drafted by the model's own MTP layer (at most ``k`` a round;
    ``options`` go to ``speculative_step``) and check the run is plain greedy's
    (``assert_mtp_run_is_plain``). ``during()`` runs while the drafter follows the model."""
    want = plain_greedy(model, prompt, n)
    stats = StatsCounter()
    drafter = MTPDrafter(model, k)
    try:
        if during is not None:
            during()
        got = list(
            speculative_step(
                prompt, model, model.make_cache(), drafter, max_tokens=n, stats=stats, logprobs=True, **options
            )
        )
    finally:
        drafter.close()
    assert_mtp_run_is_plain(model, prompt, want, got, stats)


def first_draft_logits(model, prompt: list[int], n: int = 9, k: int = 3) -> tuple[mx.array, list[int]]:
    """Decode ``n`` tokens drafted by the model's MTP layer (``k`` a round), feed the pending
    token, and return the logits of the drafter's next first draft with the ids they follow
    (the history and the target's next token), for a test to compute afresh."""
    drafter = MTPDrafter(model, k)
    cache = model.make_cache()
    seen = []

    def pick(logits, recent):
        seen.append(logits)
        return mx.argmax(logits, keepdims=True).astype(mx.uint32), None

    try:
        out = speculative_step(prompt, model, cache, drafter, max_tokens=n, num_draft_tokens=k)
        history = prompt + [t for t, _ in out]
        model(mx.array([history[-1:]]), cache=cache)  # the target's pass over the pending token
        nxt = int(mx.argmax(model.logits(drafter._passes[-1][1])[0, -1]).item())
        drafter.propose(history + [nxt], 1, pick)
    finally:
        drafter.close()
    return seen[0], history + [nxt]
