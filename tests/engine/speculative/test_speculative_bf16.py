"""Speculative greedy equals plain greedy in bfloat16, token for token, for each family whose
verify pass differs most from a one-token step: plain attention (Qwen3), the hybrid stacks
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next: gated DeltaNet beside gated attention) and latent attention
with routed experts (DeepSeek V3, Moonlight), drafted by n-gram lookup and by the checkpoints'
own MTP layers, through the plain forward pass and through the compiled decode steps.

In bfloat16 every op rounds to 8 bits of mantissa, so a verify pass of k + 1 tokens gives the
numbers of k + 1 one-token steps only where each op computes each row exactly as it would
alone: any other association (a mask instead of the exact key prefix, a float32 upcast in
one path, rows summed in another order) shows up as a flipped near-tie within a reply of this
length. MLX's CPU build computes its matmuls, convolutions and attention row by row, so here
any difference is ours; on CUDA the matmul kernels themselves depend on the number of rows
(``python -m engine.cli.bench_verify --primitives`` shows which).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from test_mtp import with_mtp
from test_mtp_deepseek import load as load_deepseek

from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.loop import generate_step
from engine.decode.mtp_drafter import MTPDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import load_golden  # noqa: E402
from test_hybrid_families import build  # noqa: E402

N = 48  # long enough for rounds that accept drafts and rounds that reject them
HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
LATENT = ["deepseek_v3", "moonlight"]


def in_bf16(model):
    model.set_dtype(mx.bfloat16)  # as a bf16 checkpoint loads (routers stay float32)
    mx.eval(model.parameters())
    return model


def load(name: str, mtp: bool):
    if name in HYBRID:
        model, expected = with_mtp(name) if mtp else build(name)
    elif name == "deepseek_v3" or (name in LATENT and mtp):
        model, expected = load_deepseek(name, with_mtp=mtp)
    else:
        model, expected = load_golden(name)
    return in_bf16(model), expected


def plain(model, prompt: list[int], compiled: bool) -> list[int]:
    """The engine's plain loop: the prompt but its last id prefilled, then one token a step.
    (A reference that prefills the whole prompt computes the first token's logits in the
    prefill's form, which for latent attention is the expanded one, not the step's.)"""
    steps = generate_step(mx.array(prompt), model, model.make_cache(), max_tokens=N, compiled=compiled)
    return [t for t, _ in steps]


def speculative(model, prompt, drafter, **options):
    stats = StatsCounter()
    try:
        got = speculative_step(prompt, model, model.make_cache(), drafter, max_tokens=N, stats=stats, **options)
        return [t for t, _ in got], stats
    finally:
        getattr(drafter, "close", lambda: None)()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["qwen3"] + HYBRID + LATENT)
def test_ngram_and_self_drafted_greedy_is_plain_greedy_in_bf16(name, compiled):
    model, expected = load(name, mtp=False)
    prompt = expected["prompt_ids"][:12] * 3  # repeats: the lookup finds drafts
    want = plain(model, prompt, compiled)
    # n-gram lookup: drafts a random model mostly rejects (rolled back, recurrent states too).
    got, stats = speculative(model, prompt, NgramDrafter(n=2, max_draft=4), compiled=compiled)
    assert got == want
    assert stats.draft_tokens > stats.accepted_draft_tokens
    # The model drafting for itself: every draft accepted, so every row of every verify pass
    # (4 drafts: 5 rows) is emitted and must be what a one-token step gives.
    drafter = DraftModelDrafter(model, model.make_cache(), 4)
    got, stats = speculative(model, prompt, drafter, num_draft_tokens=4, compiled=compiled)
    assert got == want
    assert stats.accepted_draft_tokens == stats.draft_tokens >= N // 2


@pytest.mark.parametrize("k", [8, 12])
@pytest.mark.parametrize("name", LATENT)
def test_deep_verify_passes_attend_in_the_steps_form(name, k):
    """A verify pass of 9 or more queries took latent attention's expanded form (a prompt's),
    which rounds otherwise than a step's absorbed form: DeepSeek V3 drafting for itself with
    8 drafts rejected 7 of its own 49 and its output parted from plain greedy at token 5."""
    model, expected = load(name, mtp=False)
    prompt = expected["prompt_ids"][:12] * 3
    got, stats = speculative(model, prompt, DraftModelDrafter(model, model.make_cache(), k), num_draft_tokens=k)
    assert got == plain(model, prompt, False)
    assert stats.accepted_draft_tokens == stats.draft_tokens > 0


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", HYBRID + LATENT)
def test_mtp_greedy_is_plain_greedy_in_bf16(name, k):
    model, expected = load(name, mtp=True)
    prompt = expected["prompt_ids"][:20]
    want = plain(model, prompt, compiled=True)
    got, stats = speculative(model, prompt, MTPDrafter(model, k), num_draft_tokens=k, compiled=True)
    assert got == want
    assert stats.draft_tokens > stats.accepted_draft_tokens  # random MTP weights: rejected, rolled back


def test_a_verify_pass_routes_its_tokens_as_steps_do(monkeypatch):
    """8 tokens x 8 experts (Qwen3.5-35B-A3B's top-8, a pass of 7 drafts) sorted the tokens by
    expert, which on a GPU runs other expert kernels than a step's unsorted gather; passes of
    up to 32 tokens stay unsorted, longer ones (prefill) still sort."""
    from engine.models.switch import SwitchGLU, SwitchLinear

    glu = SwitchGLU(32, 16, 16)
    seen = []
    call = SwitchLinear.__call__
    monkeypatch.setattr(
        SwitchLinear,
        "__call__",
        lambda self, x, idx, sorted_indices=False: seen.append(sorted_indices) or call(self, x, idx, sorted_indices),
    )
    for tokens, sorts in ((1, False), (8, False), (32, False), (33, True)):
        seen.clear()
        chosen = mx.argsort(mx.random.normal((1, tokens, 16), key=mx.random.key(tokens)), axis=-1)[..., :8]
        mx.eval(glu(mx.random.normal((1, tokens, 32)), chosen.astype(mx.uint32)))
        assert seen == [sorts] * 3, tokens


@pytest.mark.parametrize("name", LATENT)
def test_nine_verified_rows_are_nine_steps_bitwise(name):
    from engine.cli.bench_verify import compare

    model, expected = load(name, mtp=False)
    ids = mx.array((expected["prompt_ids"] * 3)[:49], dtype=mx.uint32)
    rows = dict(compare(model, ids[:40], ids[40:]))
    assert rows["logits (whole pass)"] == 0.0 and max(rows.values()) == 0.0, rows
