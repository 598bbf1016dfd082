"""Batched prefill and admission: waiting sequences prefill together into batch rows and
write the same caches as prefilling alone; a newcomer joins while others decode; a
sequence cancelled mid-prefill leaves cleanly; a sequence whose full-length KV does not
fit the memory budget's room waits, or is refused when nothing else runs."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.api import GenerationParams, GenerationResult
from engine.decode.batch import WAIT, Batch
from engine.decode.loop import WAITING, generate, stream_generate
from engine.errors import OutOfKVRoom
from engine.models.kv_cache import make_prompt_cache
from tests.engine.decode.test_batch import prompts
from tests.engine.models.model_goldens import load_golden


def drive(batch, streams, rounds=500, on_round=None):
    """Step ``streams`` (index -> generator) round by round; each one's result and the
    round of each of its tokens."""
    results: dict[int, Any] = {}
    token_rounds: dict[int, list[int]] = {}
    live = dict(streams)
    for r in range(rounds):
        if on_round is not None:
            on_round(r, live)
        for i, s in list(live.items()):
            for item in s:
                if item is WAITING or item == WAIT:
                    break
                if isinstance(item, GenerationResult):
                    results[i] = item
                elif isinstance(item, tuple):  # a bare sequence's (token, logprob)
                    token_rounds.setdefault(i, []).append(r)
                    results.setdefault(i, SimpleNamespace(token_ids=[], token_logprobs=[]))
                    results[i].token_ids.append(item[0])
                    results[i].token_logprobs.append(item[1])
            else:
                del live[i]
        if not live:
            break
        batch.step()
    return results, token_rounds


def sequence(batch, model, prompt, n, chunk=512):
    """A bare greedy sequence in ``batch`` (yields each token as the batch gives it)."""
    return batch.sequence(
        mx.array(prompt, dtype=mx.uint32),
        make_prompt_cache(model),
        max_tokens=n,
        sampler=lambda x: mx.argmax(x, axis=-1),
        greedy=True,
        logprobs=True,
        prefill_chunk=chunk,
    )


def params(n: int, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True, **kw)


def cache_arrays(cache):
    return [np.array(a) for c in cache for a in c.state]


def test_batched_prefill_writes_the_caches_prefilling_alone_writes():
    model, _ = load_golden("qwen3")
    ps = prompts(model.args.vocab_size, (7, 19, 3, 12, 15))
    caches = [make_prompt_cache(model) for _ in ps]
    # The last one already holds 5 of its tokens (prefix reuse): only the rest is fed.
    model(mx.array([ps[4][:5]], dtype=mx.uint32), cache=caches[4])
    mx.eval([c.state for c in caches[4]])
    batch = Batch(model)
    streams = {
        i: stream_generate(
            model, None, p[5:] if i == 4 else p, caches[i], params(1, prefill_chunk=10), batch=batch, cached_tokens=0
        )
        for i, p in enumerate(ps)
    }
    results, _ = drive(batch, streams)
    assert batch.times.prefill_tokens == sum(len(p) - 1 for p in ps) - 5  # the cached 5 not again
    for i, p in enumerate(ps):
        ref_cache = make_prompt_cache(model)
        ref = generate(model, None, p, ref_cache, params(1))
        assert results[i].token_ids == ref.token_ids
        assert np.allclose(results[i].token_logprobs, ref.token_logprobs, atol=1e-4)
        assert caches[i][0].offset == len(p) == ref_cache[0].offset
        for ours, theirs in zip(cache_arrays(caches[i]), cache_arrays(ref_cache), strict=True):
            assert np.allclose(ours, theirs, atol=1e-5)


def test_a_sequence_joins_while_others_decode_and_they_keep_stepping():
    model, _ = load_golden("llama")
    ps = prompts(model.args.vocab_size, (6, 33, 9))
    batch = Batch(model)
    jobs = [(ps[0], params(20)), (ps[1], params(6, prefill_chunk=4)), (ps[2], params(8))]
    streams: dict[int, object] = {}

    def arrive(r, live):
        if r == 0:
            live[0] = streams[0] = sequence(batch, model, jobs[0][0], 20)
        if r == 3:  # both arrive while the first decodes
            for i in (1, 2):
                p, q = jobs[i]
                live[i] = streams[i] = sequence(batch, model, p, q.max_tokens, q.prefill_chunk)

    results, token_rounds = drive(batch, {}, on_round=arrive)
    for i, (p, q) in enumerate(jobs):
        ref = generate(model, None, p, make_prompt_cache(model), q)
        assert results[i].token_ids == ref.token_ids
        assert np.allclose(results[i].token_logprobs, ref.token_logprobs, atol=1e-4)
    # The first kept its one token per round while the newcomer's 32 ids went in 8 passes
    # (shared with the short one at first): no round without a token for it.
    first = token_rounds[0]
    assert first == list(range(first[0], first[0] + 20))
    assert token_rounds[1][0] > token_rounds[2][0] > 3


def test_a_sequence_cancelled_mid_prefill_leaves_its_prefix_and_the_others_carry_on():
    model, _ = load_golden("qwen2")
    ps = prompts(model.args.vocab_size, (5, 41))
    batch = Batch(model)
    cancel = threading.Event()
    cache = make_prompt_cache(model)
    progress: list[int] = []
    streams = {
        0: stream_generate(model, None, ps[0], make_prompt_cache(model), params(12), batch=batch),
        1: stream_generate(
            model,
            None,
            ps[1],
            cache,
            params(4, prefill_chunk=8),
            batch=batch,
            cancel=cancel,
            on_progress=lambda done, total: progress.append(done),
        ),
    }

    def maybe_cancel(r, live):
        if len(progress) == 2:
            cancel.set()

    results, _ = drive(batch, streams, on_round=maybe_cancel)
    assert results[1].finish_reason == "cancelled" and results[1].token_ids == []
    assert not batch.filling and not batch.waiting and not batch.rows
    # Its cache holds exactly the prompt ids prefilled before the cancel, as prefilling alone.
    done = progress[-1]
    assert 0 < done < 40 and cache[0].offset == done
    ref = make_prompt_cache(model)
    model(mx.array([ps[1][:done]], dtype=mx.uint32), cache=ref)
    for ours, theirs in zip(cache_arrays(cache), cache_arrays(ref), strict=True):
        assert np.allclose(ours, theirs, atol=1e-5)
    assert results[0].token_ids == generate(model, None, ps[0], make_prompt_cache(model), params(12)).token_ids


def test_a_sequence_waits_for_kv_room_and_is_refused_when_it_never_fits():
    model, _ = load_golden("llama")
    ps = prompts(model.args.vocab_size, (6, 8))
    per_token = 1000
    # Room for one sequence of up to 30 tokens at full length, not two.
    batch = Batch(model, kv_room=lambda need: 30 * per_token, kv_bytes_per_token=per_token)
    streams = {i: sequence(batch, model, p, 16) for i, p in enumerate(ps)}
    results, token_rounds = drive(batch, streams)
    for i, p in enumerate(ps):
        assert results[i].token_ids == generate(model, None, p, make_prompt_cache(model), params(16)).token_ids
    assert token_rounds[1][0] > token_rounds[0][-1]  # it joined once the first had left

    # 8 + 40 tokens cannot fit even alone: refused, one line, nothing left behind.
    stream = sequence(batch, model, ps[1], 40)
    with pytest.raises(OutOfKVRoom) as refused:
        drive(batch, {0: stream})
    message = str(refused.value)
    assert "\n" not in message and "48 tokens" in message and "max_tokens" in message
    assert not batch.active


def test_rows_sharing_sampling_settings_are_filtered_together_and_draw_as_alone():
    from engine.api import SamplingParams
    from engine.decode.loop import generate_step
    from engine.decode.sampling import make_sampler

    model, _ = load_golden("qwen3")
    ps = prompts(model.args.vocab_size, (7, 9, 5))
    settings = [SamplingParams(temperature=0.9, top_p=0.8, top_k=30, seed=s) for s in (1, 2, 3)]
    batch = Batch(model)
    filtered_rows: list[int] = []

    def counted(sampler):
        inner = sampler.filtered
        sampler.filtered = lambda x: (filtered_rows.append(x.shape[0]), inner(x))[1]
        return sampler

    streams = {
        i: batch.sequence(
            mx.array(p, dtype=mx.uint32),
            make_prompt_cache(model),
            max_tokens=10,
            sampler=counted(make_sampler(sp)),
            greedy=False,
        )
        for i, (p, sp) in enumerate(zip(ps, settings, strict=True))
    }
    results, _ = drive(batch, streams)
    assert filtered_rows and set(filtered_rows) == {3}  # one filter call per step for all three
    for i, (p, sp) in enumerate(zip(ps, settings, strict=True)):
        alone = [
            t
            for t, _ in generate_step(
                mx.array(p, dtype=mx.uint32), model, make_prompt_cache(model), max_tokens=10, sampler=make_sampler(sp)
            )
        ]
        assert results[i].token_ids == alone
