"""A batch holds a shared prefix once: rows whose paged caches start with the same published
blocks attend over one copy of it (engine/decode/batch_cache.py), and each row still
equals itself decoded alone without paging.

Golden tiny checkpoints (float32). One chat first publishes a system prompt's blocks, as
a server that has answered once holds them; then streams asking their own questions after
it decode together, joining at different rounds, beside a stream with another prompt that
does not see the prefix.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.api import GenerationParams
from engine.decode import batch as batch_module
from engine.decode.batch import Batch
from engine.decode.batch_cache import MAX_PREFIXES, NO_PREFIX
from engine.decode.loop import generate, stream_generate
from engine.models.cache_buffers import buffer_tokens
from engine.models.kv_cache import make_prompt_cache
from engine.models.paged_kv import pool_for
from engine.runtime.prefix_cache import PrefixCache
from tests.engine.batch_rounds import drive
from tests.engine.models.model_goldens import load_golden

BLOCK = 16


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _publish(model, system: list[int]) -> None:
    """One chat over ``system`` (its reply ignored) publishes the prompt's whole blocks."""
    chat = PrefixCache(model)
    ids = [*system, 5]
    keep = chat.reuse(ids)
    out = generate(model, None, ids[keep:], chat.cache, GenerationParams(max_tokens=2, ignore_eos=True))
    chat.record(ids + out.token_ids, ids + out.token_ids)


def _run_together(model, prompts, starts, max_tokens, *, batch=None, on_round=None):
    """Each prompt as a stream through its own PrefixCache (taking the pool's blocks), the
    i-th joining at round ``starts[i]``; their results and the batch."""
    batch = batch or Batch(model)

    def start(i):
        chat = PrefixCache(model)
        keep = chat.reuse(prompts[i])
        params = GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, prefill_chunk=8)
        return stream_generate(model, None, prompts[i][keep:], chat.cache, params, cached_tokens=keep, batch=batch)

    results = drive(batch, starts, start, on_round=on_round)
    return [results[i] for i in range(len(prompts))], batch


def _kv_bytes_per_token(model) -> int:
    """Keys and values of one token over every layer, float32 (the goldens' dtype)."""
    attn = model.layers[0].self_attn
    return 2 * 4 * len(model.layers) * attn.n_kv_heads * attn.head_dim


def _sees_each_round(seen: list[list[int]]):
    """An ``on_round`` that notes which shared prefix each decoding row saw (NO_PREFIX: none)."""
    return lambda b: seen.append(list(b.layers[0].sees)) if b.layers else None


def _seeing(row: list[int]) -> int:
    return sum(j != NO_PREFIX for j in row)


def _assert_each_equals(refs, got) -> None:
    for ref, result in zip(refs, got, strict=True):
        assert result.token_ids == ref.token_ids
        assert np.allclose(result.token_logprobs, ref.token_logprobs, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_sharing_a_prefix_equal_themselves_alone(family):
    model, _ = load_golden(family)
    vocab = model.args.vocab_size
    system = _ids(vocab, 5 * BLOCK + 3, seed=1)  # ends inside a block: the rows hold that part
    prompts = [system + _ids(vocab, n, seed=10 + i) for i, n in enumerate((9, 4, 13))]
    prompts.append(_ids(vocab, 23, seed=30))  # another prompt: it must not see the prefix
    refs = [
        generate(
            model, None, p, make_prompt_cache(model), GenerationParams(max_tokens=7, ignore_eos=True, logprobs=True)
        )
        for p in prompts
    ]
    pool_for(model, block_size=BLOCK)
    seen: list[list[int]] = []
    try:
        _publish(model, system)
        got, batch = _run_together(
            model,
            prompts,
            starts=[0, 0, 2, 1],
            max_tokens=7,
            on_round=_sees_each_round(seen),
        )
    finally:
        del model.kv_pool
    _assert_each_equals(refs, got)
    # Rows did decode over the shared prefix, beside one that did not see it.
    assert any(_seeing(s) >= 2 and NO_PREFIX in s for s in seen)
    assert not batch.rows and not batch.layers


def test_eight_streams_hold_a_shared_prefix_once():
    """Eight streams after one 4,096-token system prompt: the batch holds it once (measured
    with MLX's active memory while they decode), where rows holding their own copies hold
    it eight times."""
    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    system = _ids(vocab, 256 * BLOCK, seed=2)
    prompts = [system + _ids(vocab, 8, seed=40 + i) for i in range(8)]
    pool_for(model, block_size=BLOCK)
    try:
        _publish(model, system)
        per_token = _kv_bytes_per_token(model)
        prefix_bytes = per_token * len(system)

        def held_while_decoding(shares: bool) -> tuple[int, list[list[int]]]:
            batch = Batch(model)
            batch.shares_prefixes = shares
            mx.clear_cache()
            before = mx.get_active_memory()
            peak = [0, 0]

            def measure(b):
                if len(b.rows) == 8:
                    mx.eval([s for layer in b.layers for s in layer.state])
                    held = mx.get_active_memory() - before
                    if held > peak[0]:
                        peak[:] = [held, b.nbytes]

            got, _ = _run_together(model, prompts, [0] * 8, 6, batch=batch, on_round=measure)
            return peak[0], peak[1], [r.token_ids for r in got]

        shared, rows_bytes, shared_ids = held_while_decoding(True)
        own, _, own_ids = held_while_decoding(False)
    finally:
        del model.kv_pool
    assert shared_ids == own_ids
    assert own > 7 * prefix_bytes  # each row its own copy: the measure sees them
    # Nothing beside the rows' own tokens: the prefix is the pool's blocks, read in place.
    assert rows_bytes <= 8 * buffer_tokens(1) * per_token  # each row its question and reply, in one buffer's room
    assert shared < rows_bytes + prefix_bytes / 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_streams_arriving_together_prefill_their_common_prompt_once(family):
    """Nothing published yet: streams that arrive together with one system prompt wait for
    the first one's prefill and borrow its blocks, then decode over one copy of them."""
    model, _ = load_golden(family)
    vocab = model.args.vocab_size
    system = _ids(vocab, 6 * BLOCK + 5, seed=3)
    prompts = [system + _ids(vocab, n, seed=50 + i) for i, n in enumerate((6, 11, 3))]
    prompts.append(_ids(vocab, 30, seed=60))
    params = GenerationParams(max_tokens=6, ignore_eos=True, logprobs=True)
    refs = [generate(model, None, p, make_prompt_cache(model), params) for p in prompts]
    pool_for(model, block_size=BLOCK)
    seen: list[list[int]] = []
    try:
        got, batch = _run_together(
            model,
            prompts,
            [0, 0, 0, 0],
            6,
            on_round=_sees_each_round(seen),
        )
    finally:
        del model.kv_pool
    _assert_each_equals(refs, got)
    # The six common blocks were prefilled once, not three times.
    every = sum(len(p) - 1 for p in prompts)
    assert batch.times.prefill_tokens == every - 2 * 6 * BLOCK
    assert any(_seeing(s) == 3 for s in seen)


@pytest.mark.parametrize("room", [MAX_PREFIXES, 1])
def test_two_system_prompts_are_each_held_once_beside_each_other(room, monkeypatch):
    """Two kinds of agent, each with its own published system prompt, decode together: each
    group attends over its own prompt held once (two prefixes in the batch), and every
    stream equals itself alone. With room for one prefix, the other group holds its own
    copies and still equals itself."""
    monkeypatch.setattr(batch_module, "MAX_PREFIXES", room)
    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    systems = [_ids(vocab, n * BLOCK + 2, seed=80 + n) for n in (4, 3)]
    prompts = [systems[i % 2] + _ids(vocab, 5 + i, seed=90 + i) for i in range(4)]
    params = GenerationParams(max_tokens=6, ignore_eos=True, logprobs=True)
    refs = [generate(model, None, p, make_prompt_cache(model), params) for p in prompts]
    pool_for(model, block_size=BLOCK)
    seen: list[list[int]] = []
    try:
        for system in systems:
            _publish(model, system)
        got, batch = _run_together(model, prompts, [0, 1, 0, 2], 6, on_round=_sees_each_round(seen))
    finally:
        del model.kv_pool
    _assert_each_equals(refs, got)
    full = [s for s in seen if len(s) == 4]
    assert full
    if room >= 2:
        assert all(sorted(s) == [0, 0, 1, 1] for s in full)
    else:
        assert all(sorted(s) == [NO_PREFIX, NO_PREFIX, 0, 0] for s in full)
    assert not batch.rows and not batch.layers


def test_rows_leaving_one_by_one_do_not_keep_the_batchs_old_buffers():
    """Each row leaving used to take a slice of the batch's buffer back into its cache, which
    kept that whole buffer alive: eight rows leaving in turn held up to eight generations of
    it. Measured with MLX's active memory, everything held stays within twice the rows' KV."""
    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    prompts = [_ids(vocab, 512, seed=70 + i) for i in range(8)]
    per_token = _kv_bytes_per_token(model)
    rows_kv = per_token * 8 * buffer_tokens(513)  # the rows' tokens and a buffer's room each
    batch = Batch(model)
    caches = [make_prompt_cache(model) for _ in prompts]
    held: list[int] = []

    def measure(_batch) -> None:
        mx.eval([a for c in caches for layer in c for a in layer.state])
        held.append(mx.get_active_memory() - before)

    def start(i):
        sample = lambda x: mx.argmax(x, -1)  # noqa: E731
        return batch.sequence(mx.array(prompts[i]), caches[i], max_tokens=2 + i, sampler=sample, greedy=True)

    mx.clear_cache()
    before = mx.get_active_memory()
    drive(batch, [0] * len(prompts), start, on_round=measure, limit=100)
    assert max(held) < 2 * rows_kv, (max(held), rows_kv)


def test_sixteen_streams_joining_and_leaving_peak_within_three_times_their_kv():
    """Rows joining (a concatenation each) and leaving (a gather each) made chains of
    growing copies that the next step computed with every one alive: 16 streams over
    512-token prompts peaked at 5.9x their keys and values (MLX's peak memory). Rows
    joining in one round now take one concatenation and rows leaving one gather (2.7x)."""
    model, _ = load_golden("qwen3")
    vocab = model.args.vocab_size
    prompts = [_ids(vocab, 512, seed=100 + i) for i in range(16)]
    kv = _kv_bytes_per_token(model) * 16 * 512
    batch = Batch(model)
    caches = [make_prompt_cache(model) for _ in prompts]

    def start(i):
        sample = lambda x: mx.argmax(x, -1)  # noqa: E731
        return batch.sequence(mx.array(prompts[i]), caches[i], max_tokens=8, sampler=sample, greedy=True)

    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    drive(batch, [0] * len(prompts), start, limit=400)
    mx.synchronize()
    peak = mx.get_peak_memory() - before
    assert peak < 3 * kv, (peak / kv, kv)
