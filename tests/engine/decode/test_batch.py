"""Continuous batching: each sequence decoded among others equals itself decoded alone.

Golden tiny checkpoints of each batchable family (float32); prompts of different lengths
join the batch at different steps (so rows are left-padded differently and positions
differ), with their own sampling settings.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import GenerationParams, GenerationResult, SamplingParams
from engine.decode.batch import Batch, batchable
from engine.decode.loop import WAITING, generate, stream_generate
from engine.models.kv_cache import make_prompt_cache
from tests.engine.batch_rounds import drive
from tests.engine.models.model_goldens import load_golden

BATCHED = ["llama", "llama3_rope", "qwen2", "qwen3", "qwen3_moe"]
ALONE = ["mistral", "gemma2", "llama_dynamic", "phi3", "smollm3", "gpt_oss", "deepseek_v3"]


def prompts(vocab: int, lengths=(7, 19, 3, 12)) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def run_batched(model, jobs, starts, *, chunk=4):
    """Drive one stream per (prompt, params), the i-th joining at round ``starts[i]``;
    return each one's GenerationResult and the batch."""
    batch = Batch(model)

    def start(i):
        prompt, params = jobs[i]
        params.prefill_chunk = chunk
        return stream_generate(model, None, prompt, make_prompt_cache(model), params, batch=batch)

    results = drive(batch, starts, start)
    return [results[i] for i in range(len(jobs))], batch


def alone(model, prompt, params):
    return generate(model, None, prompt, make_prompt_cache(model), params)


@pytest.mark.parametrize("family", BATCHED)
def test_greedy_batched_equals_alone(family):
    model, _ = load_golden(family)
    assert batchable(model)
    vocab = model.args.vocab_size
    jobs = [
        (p, GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True))
        for p, n in zip(prompts(vocab), (10, 6, 12, 8), strict=True)
    ]
    got, batch = run_batched(model, jobs, starts=[0, 0, 3, 5])
    for (prompt, params), result in zip(jobs, got, strict=True):
        ref = alone(model, prompt, GenerationParams(max_tokens=params.max_tokens, ignore_eos=True, logprobs=True))
        assert result.token_ids == ref.token_ids
        assert np.allclose(result.token_logprobs, ref.token_logprobs, atol=1e-4)
        assert result.finish_reason == "length"
    # Fewer forward passes than the sequences took alone: they shared steps.
    assert batch.steps < sum(n.max_tokens for _, n in jobs)
    assert not batch.rows and not batch.layers


def test_each_row_keeps_its_own_sampler_penalty_and_stop():
    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    ps = prompts(vocab)
    settings = [
        GenerationParams(
            max_tokens=9,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
            sampling=SamplingParams(temperature=0.9, top_k=20, seed=7),
        ),
        GenerationParams(
            max_tokens=7, ignore_eos=True, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3)
        ),
        GenerationParams(max_tokens=11, ignore_eos=True, logprobs=True),
        GenerationParams(max_tokens=5, ignore_eos=True, sampling=SamplingParams(temperature=1.2, top_p=0.8, seed=3)),
    ]
    jobs = list(zip(ps, settings, strict=True))
    got, _ = run_batched(model, jobs, starts=[0, 1, 1, 4])
    for (prompt, params), result in zip(jobs, got, strict=True):
        ref = alone(model, prompt, params)
        assert result.token_ids == ref.token_ids
        if params.logprobs:
            assert np.allclose(result.token_logprobs, ref.token_logprobs, atol=1e-4)
        if params.top_logprobs:
            assert [[t for t, _ in row] for row in result.top_logprobs] == [
                [t for t, _ in row] for row in ref.top_logprobs
            ]


def test_a_cancelled_sequence_leaves_and_the_others_carry_on():
    import threading

    model, _ = load_golden("llama")
    ps = prompts(model.args.vocab_size)
    batch = Batch(model)
    cancel = threading.Event()
    params = [GenerationParams(max_tokens=12, ignore_eos=True) for _ in ps[:3]]
    streams = [
        stream_generate(model, None, p, make_prompt_cache(model), q, batch=batch, cancel=cancel if i == 1 else None)
        for i, (p, q) in enumerate(zip(ps, params, strict=False))
    ]
    results: dict[int, GenerationResult] = {}
    for rounds in range(100):
        if rounds == 4:
            cancel.set()
        for i, s in enumerate(streams):
            if i in results:
                continue
            for item in s:
                if item is WAITING:
                    break
                if isinstance(item, GenerationResult):
                    results[i] = item
        batch.step()
        if len(results) == 3:
            break
    assert results[1].finish_reason == "cancelled" and len(results[1].token_ids) < 12
    for i in (0, 2):
        assert results[i].token_ids == alone(model, ps[i], params[i]).token_ids


def test_newcomers_prefill_together_one_chunk_per_step_of_the_running_ones():
    model, _ = load_golden("qwen2")
    batch = Batch(model)
    running = stream_generate(
        model, None, [5, 6, 7], make_prompt_cache(model), GenerationParams(max_tokens=40, ignore_eos=True), batch=batch
    )
    progress: list[tuple[int, int, int]] = []
    newcomers = [
        stream_generate(
            model,
            None,
            list(range(3, 3 + n)),
            make_prompt_cache(model),
            GenerationParams(max_tokens=2, ignore_eos=True, prefill_chunk=8),
            batch=batch,
            on_progress=lambda done, total, i=i: progress.append((i, done, total)),
        )
        for i, n in enumerate((41, 25))
    ]
    live = [running]
    per_round: list[tuple[int, int, int]] = []
    for rounds in range(30):
        if rounds == 2:
            live += newcomers  # both arrive while the first decodes
        before = (batch.prefills, batch.steps, batch.times.prefill_tokens)
        for s in list(live):
            for item in s:
                if item is WAITING:
                    break
            else:
                live.remove(s)
        batch.step()
        per_round.append((batch.prefills - before[0], batch.steps - before[1], batch.times.prefill_tokens - before[2]))
    # One prefill pass of at most one chunk (8 tokens, shared by the rows) per round, and a
    # decode step in every round: the running sequence never waits longer than one chunk.
    assert all(p <= 1 and s >= 1 and t <= 8 for p, s, t in per_round[1:]), per_round  # round 0: its own
    # Both newcomers prefilled together (4 tokens each per pass); the shorter one was in
    # after 6 passes, then the longer one had the chunk to itself.
    first = [d for i, d, _ in progress if i == 0]
    second = [d for i, d, _ in progress if i == 1]
    assert second == [4, 8, 12, 16, 20, 24]
    assert first == [4, 8, 12, 16, 20, 24, 32, 40]
    assert not batch.filling and not batch.waiting and len(live) == 1  # the first still decodes


@pytest.mark.parametrize("family", ALONE)
def test_families_whose_caches_do_not_batch_say_so(family):
    model, _ = load_golden(family)
    assert not batchable(model)


def test_compiled_batch_steps_equal_the_plain_ones(monkeypatch):
    # The compiled decoder is what a GPU uses; forced here on the CPU (slow to trace, so
    # one family and few tokens).
    from engine.decode.compiled_step import CompiledDecoder

    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    jobs = [
        (p, GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True))
        for p, n in zip(prompts(vocab, (5, 9)), (6, 4), strict=True)
    ]
    plain, _ = run_batched(model, jobs, starts=[0, 2])
    compiled_steps = []
    rows = CompiledDecoder.rows

    def counted(self, tokens, cache):
        out = rows(self, tokens, cache)
        compiled_steps.append((out is not None, tokens.shape[0]))
        return out

    monkeypatch.setattr(CompiledDecoder, "rows", counted)
    defaults = {**Batch.__init__.__kwdefaults__, "compiled": True}
    monkeypatch.setattr("engine.decode.batch.Batch.__init__.__kwdefaults__", defaults)
    got, _ = run_batched(model, jobs, starts=[0, 2])
    assert compiled_steps and all(ok for ok, _ in compiled_steps)  # every step ran compiled, padded rows included
    assert {n for _, n in compiled_steps} == {1, 2}
    for ours, ref in zip(got, plain, strict=True):
        assert ours.token_ids == ref.token_ids
        assert np.allclose(ours.token_logprobs, ref.token_logprobs, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_paged_sequences_batch_and_equal_themselves_alone(family):
    """Paged caches join the batch as plain ones do: each row gathers its blocks, and its
    keys and values go back into blocks when it leaves."""
    from engine.models.paged_kv import pool_for

    model, _ = load_golden(family)
    jobs = [
        (p, GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True))
        for p, n in zip(prompts(model.args.vocab_size, (37, 19, 3, 40)), (10, 6, 12, 8), strict=True)
    ]
    refs = [alone(model, p, GenerationParams(max_tokens=n.max_tokens, ignore_eos=True, logprobs=True)) for p, n in jobs]
    pool_for(model, block_size=16)
    try:
        assert batchable(model)
        got, batch = run_batched(model, jobs, starts=[0, 0, 3, 5])
    finally:
        del model.kv_pool
    for ref, result in zip(refs, got, strict=True):
        assert result.token_ids == ref.token_ids
        assert np.allclose(result.token_logprobs, ref.token_logprobs, atol=1e-4)
    assert batch.steps < sum(n.max_tokens for _, n in jobs)
