"""The compiled decode step for hybrid stacks (gated DeltaNet + gated attention) gives the
plain forward pass's tokens, log-probs and states, and a speculative verification of a
few tokens computes what single steps compute, in bf16 too.

Driven by the tiny golden checkpoints. The CPU build compiles each new fused kernel with
a C++ compiler, so the models are built once per module and runs stay short.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.cli.bench_verify import compare
from engine.decode.compiled_hybrid import HybridDecoder, compiled_decoder
from engine.decode.drafters import DraftModelDrafter
from engine.decode.loop import generate_step
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.recurrent_cache import RecurrentCache
from engine.models.stacked import stacked_output

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hybrid_families import build  # noqa: E402

PROMPT = [(7 * i + 3) % 97 + 3 for i in range(13)]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def model(request):
    model, _ = build(request.param)
    model.set_dtype(mx.bfloat16)  # where rounding differences between paths would show
    mx.eval(model.parameters())
    return model


def decode(model, n, compiled):
    pairs = list(
        generate_step(
            mx.array(PROMPT, dtype=mx.uint32), model, model.make_cache(), max_tokens=n, logprobs=True, compiled=compiled
        )
    )
    return [t for t, _ in pairs], [float(lp) for _, lp in pairs]


def test_compiled_steps_equal_plain_steps(model):
    decoder = compiled_decoder(model)
    assert isinstance(decoder, HybridDecoder) and decoder.prepare()
    assert decode(model, 10, compiled=True) == decode(model, 10, compiled=False)
    assert 1 in decoder._fns  # the compiled step did run
    # Projections of one input run as one matmul: DeltaNet's in_proj_*, attention's q/k/v,
    # the router with the shared expert's gate.
    layers = {type(layer.linear_attn if layer.is_linear else layer.self_attn): layer for layer in model.layers}
    x = mx.zeros((1, 2, model.args.hidden_size), mx.bfloat16)
    for layer in layers.values():
        for module in (layer.linear_attn if layer.is_linear else layer.self_attn, layer.mlp):
            for names in getattr(type(module), "stacked_projections", ()):
                assert stacked_output(module, names, x) is not None, (type(module).__name__, names)


def test_self_drafting_is_exact_and_fully_accepted(model):
    """The model drafting for itself: every greedy draft must be accepted, and the output is
    plain greedy's. A verify pass that computed other logits than single steps (or a state
    rolled back to the wrong token) would reject drafts or change tokens."""
    plain, _ = decode(model, 16, compiled=False)
    for compiled in (False, True):
        stats = StatsCounter()
        got = speculative_step(
            PROMPT,
            model,
            model.make_cache(),
            DraftModelDrafter(model, None, 3, 64, compiled=compiled),
            max_tokens=16,
            num_draft_tokens=3,
            stats=stats,
            compiled=compiled,
        )
        assert [t for t, _ in got] == plain
        assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens


def test_compiled_verify_pass_keeps_the_state_after_each_token(model):
    """Four tokens through the compiled decoder, then rolled back one at a time: each restored
    state is the one single plain steps reach."""
    decoder = compiled_decoder(model)
    assert decoder.prepare()
    tokens = mx.array([11, 5, 42, 7], dtype=mx.uint32)
    steps = model.make_cache()
    model(mx.array([PROMPT]), cache=steps)
    seen = []
    for t in range(4):
        model(tokens[None, t : t + 1], cache=steps)
        seen.append([list(c.arrays) for c in steps if isinstance(c, RecurrentCache)])
    fast = model.make_cache()
    model(mx.array([PROMPT]), cache=fast)
    plain = model.make_cache()
    model(mx.array([PROMPT]), cache=plain)
    got = decoder(tokens, fast)
    want = model(tokens[None], cache=plain)[0]
    assert got is not None and mx.array_equal(got, want).item()
    for back in range(4):
        recurrent = [c for c in fast if isinstance(c, RecurrentCache)]
        for c, state in zip(recurrent, seen[3 - back]):
            assert all(mx.array_equal(a, b).item() for a, b in zip(c.arrays, state))
        assert all(c.trim(1) == 1 for c in fast)


def test_long_passes_and_fresh_caches_take_the_plain_pass(model):
    decoder = compiled_decoder(model)
    assert decoder.prepare()
    cache = model.make_cache()
    assert decoder(mx.array([3], dtype=mx.uint32), cache) is None  # no state yet: the prefill makes it
    model(mx.array([PROMPT]), cache=cache)
    window = next(c for c in cache if isinstance(c, RecurrentCache)).step_window
    assert decoder(mx.array(list(range(window + 1)), dtype=mx.uint32), cache) is None


def test_an_mtp_drafter_hears_what_the_plain_pass_tells_it(model):
    """The built-in MTP drafter follows the target through ``hidden_listener``: the compiled
    step must tell it the same ids, final hidden states and start position."""
    decoder = compiled_decoder(model)
    assert decoder.prepare()
    heard = []
    model.hidden_listener = lambda ids, hidden, start: heard.append((ids.tolist(), hidden, start))
    try:
        told = []
        for fast in (False, True):
            cache = model.make_cache()
            model(mx.array([PROMPT]), cache=cache)
            tokens = mx.array([11, 5, 42], dtype=mx.uint32)
            heard.clear()
            if fast:
                assert decoder(tokens, cache) is not None
            else:
                model(tokens[None], cache=cache)
            (ids, hidden, start), *rest = heard
            assert not rest and ids == [[11, 5, 42]] and start == len(PROMPT)
            told.append(hidden)
        assert mx.array_equal(told[0], told[1]).item()
    finally:
        model.hidden_listener = None


def test_bench_verify_finds_no_difference_and_catches_a_wrong_rollback(model, monkeypatch):
    prompt, tokens = mx.array(PROMPT, dtype=mx.uint32), mx.array([11, 5, 42, 7], dtype=mx.uint32)
    rows = dict(compare(model, prompt, tokens, compiled=True))
    assert max(rows.values()) == 0.0 and "argmax equal 4/4" in rows and "compiled logits (verify)" in rows
    assert any("delta rule" in k for k in rows) and any("attention" in k for k in rows)
    # A mutant that keeps the state one token late for rollback.
    original = RecurrentCache.record
    monkeypatch.setattr(RecurrentCache, "record", lambda self, after, arrays: original(self, after + 1, arrays))
    rows = dict(compare(model, prompt, tokens))
    assert max(v for k, v in rows.items() if "rolled back" in k) > 1e-2


def test_a_verify_pass_runs_only_the_kernels_a_decode_step_runs(model, monkeypatch):
    """A GPU picks other attention and convolution kernels for several tokens than for one,
    whose sums round otherwise (the CPU build's do not), so a verify pass that fed them
    several tokens at once gave logits unlike single steps' and rejected drafts the model
    itself had made. Each query must attend alone over its step's keys, and each token's
    window be convolved alone."""
    from engine.models import qwen3_5

    queries, windows = [], []
    sdpa, conv = qwen3_5.sdpa, nn.Conv1d.__call__
    monkeypatch.setattr(
        qwen3_5, "sdpa", lambda q, k, v, scale, mask: queries.append(q.shape[2]) or sdpa(q, k, v, scale, mask)
    )
    monkeypatch.setattr(nn.Conv1d, "__call__", lambda self, x: windows.append(x.shape[1]) or conv(self, x))
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache=cache)
    assert max(queries) == len(PROMPT)  # a prompt is one pass
    queries.clear(), windows.clear()
    model(mx.array([[11, 5, 42, 7]]), cache=cache)
    kernel = next(layer.linear_attn.conv_kernel for layer in model.layers if layer.is_linear)
    assert queries and set(queries) == {1}
    assert windows and set(windows) == {kernel}
    queries.clear()
    decoder = compiled_decoder(model)
    assert decoder.prepare() and decoder(mx.array([3, 1, 4], dtype=mx.uint32), cache) is not None
    assert queries and set(queries) == {1}
