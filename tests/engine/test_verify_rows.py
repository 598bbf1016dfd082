"""``engine.cli.verify_rows.rows_alone``: the diagnostic that runs every row of a verify pass
alone, as a one-token step runs it (to tell on a GPU whether MLX's row-count-dependent matmul
kernels are what part speculative from plain greedy in bf16)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.cli.bench_verify import compare
from engine.cli.verify_rows import rows_alone
from engine.models import mla

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
from model_goldens import load_golden  # noqa: E402


def test_a_few_rows_run_one_by_one_and_a_prompt_as_it_is(monkeypatch):
    rows_seen = []
    linear_call = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: rows_seen.append(x.shape[-2]) or linear_call(self, x))
    layer = nn.Linear(16, 8)
    x = mx.random.normal((1, 5, 16), key=mx.random.key(0))
    with rows_alone():
        alone = layer(x)
        assert rows_seen == [1] * 5
        rows_seen.clear()
        layer(mx.random.normal((1, 40, 16)))
        assert rows_seen == [40]  # a prompt's chunk: left as it is
    assert mx.array_equal(alone, layer(x)).item()  # the CPU build: the same numbers either way
    rows_seen.clear()
    layer(x)
    assert rows_seen == [5]  # and the patches are gone


def test_latent_attention_and_routing_run_each_query_alone(monkeypatch):
    model, expected = load_golden("deepseek_v3")
    model.set_dtype(mx.bfloat16)
    queries = []
    original = mla.MLAttention.__dict__["latent_attention"]

    def spy(self, q_latent, q_pe, latent, k_pe, keep, scaled=False):
        queries.append((q_latent.shape[2], latent.shape[2], keep is None))
        return original(self, q_latent, q_pe, latent, k_pe, keep, scaled)

    monkeypatch.setattr(mla.MLAttention, "latent_attention", spy)
    ids = mx.array((expected["prompt_ids"] * 3)[:45], dtype=mx.uint32)
    with rows_alone():
        rows = dict(compare(model, ids[:40], ids[40:]))
    assert max(rows.values()) == 0.0 and "argmax equal 5/5" in rows
    # The verify pass: per layer, 5 queries, each alone over its step's 41..45 keys, unmasked.
    verify = [q for q in queries if q[0] == 1 and q[2]][-5 * len(model.layers) :]
    assert sorted({keys for _, keys, _ in verify}) == [41, 42, 43, 44, 45]
    assert all(n == 1 for n, _, _ in queries)
