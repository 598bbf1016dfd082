"""The chunked (matrix) form of the gated delta rule that CUDA prefill takes.

It must give the token-by-token kernel's numbers to float32 rounding, for grouped heads,
lengths that are and are not whole chunks, carried-in state and heads that forget at once;
and a hybrid model prefilled through it must still match transformers."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_hybrid_families import TOLERANCE, assert_matches, build, greedy

import engine.models.gated_delta as gated_delta
from engine.models.delta_chunks import chunked_delta_rule


def inputs(b, t, hk, hv, dk, dv, forget=1.0, seed=0):
    mx.random.seed(seed)
    q, k = mx.random.normal((b, t, hk, dk)), mx.random.normal((b, t, hk, dk))
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
    v = mx.random.normal((b, t, hv, dv))
    log_decay = -forget * mx.logaddexp(mx.random.normal((b, t, hv)) * 2, 0)
    beta = mx.sigmoid(mx.random.normal((b, t, hv)))
    state = mx.random.normal((b, hv, dv, dk)) * 0.3
    return q, k, v, log_decay, beta, state


@pytest.mark.parametrize(
    "shape",
    [
        (1, 200, 2, 4, 16, 8),  # grouped value heads, 3 chunks and a part
        (2, 128, 2, 2, 32, 16),  # two sequences, whole chunks
        (1, 64, 1, 3, 8, 8),  # one chunk exactly, three value heads on one key head
        (1, 5, 2, 4, 16, 8),  # shorter than a chunk
    ],
)
def test_equals_the_token_by_token_kernel(shape):
    q, k, v, log_decay, beta, state = inputs(*shape)
    y_ref, s_ref = mx.fast.gated_delta_update(q, k, v, mx.exp(log_decay), beta, state)
    y, s = chunked_delta_rule(q, k, v, log_decay, beta, state)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert float(mx.abs(y - y_ref).max()) < 1e-5
    assert float(mx.abs(s - s_ref).max()) < 1e-5


def test_a_head_that_forgets_at_once_stays_finite():
    # Decays of e^-200 a token underflow the running product within a chunk: ratios of
    # those products must never be taken as inf / inf.
    q, k, v, log_decay, beta, state = inputs(1, 100, 2, 2, 16, 8, forget=200.0)
    y_ref, s_ref = mx.fast.gated_delta_update(q, k, v, mx.exp(log_decay), beta, state)
    y, s = chunked_delta_rule(q, k, v, log_decay, beta, state)
    assert bool(mx.isfinite(y).all()) and bool(mx.isfinite(s).all())
    assert float(mx.abs(y - y_ref).max()) < 1e-5


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_prefilled_in_chunked_form_matches_transformers(name, monkeypatch):
    monkeypatch.setattr(gated_delta, "chunked_pays", lambda: True)  # as on CUDA
    model, expected = build(name)
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert_matches(ids, logprobs, expected, TOLERANCE, f"{name} prefilled in chunks")
