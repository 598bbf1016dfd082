"""Caches driven by real (tiny golden) models: chunked prefill, trim, save/load."""

from __future__ import annotations

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, load_golden

from engine.decode.prefill import prefill
from engine.models.base import length_dependent_ropes
from engine.models.kv_cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from engine.runtime.prefix_cache import PrefixCache

# Phi-3's LongRoPE and "dynamic" RoPE pick frequencies from the length of each forward
# pass (as transformers does), so bare chunked and whole passes differ there by design;
# ``prefill`` tells each chunk where the whole prompt ends (tested below).
CHUNKABLE = [f for f in FAMILIES if f not in ("phi3", "llama_dynamic")]
PROMPT = [(7 * i + 3) % 97 + 3 for i in range(40)]  # 40 tokens: windows of 8-10 wrap several times


def run_chunks(model, tokens, sizes, cache):
    out, start = [], 0
    for size in sizes:
        out.append(model(mx.array([tokens[start : start + size]]), cache=cache))
        start += size
    assert start == len(tokens)
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize("name", CHUNKABLE)
def test_chunked_prefill_equals_whole_prefill(name):
    model, _ = load_golden(name)
    whole = model(mx.array([PROMPT]), cache=make_prompt_cache(model))
    uncached = model(mx.array([PROMPT]))
    for sizes in ([13, 13, 14], [5, 1, 1, 9, 24], [1] * 40):
        chunked = run_chunks(model, PROMPT, sizes, make_prompt_cache(model))
        assert mx.allclose(chunked, whole, atol=2e-4).item(), (name, sizes)
    assert mx.allclose(uncached, whole, atol=2e-4).item(), name


@pytest.mark.parametrize("name", FAMILIES)
def test_trim_then_redecode_gives_same_logits(name):
    model, _ = load_golden(name)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:4]]), cache=cache)
    first = [model(mx.array([[t]]), cache=cache) for t in PROMPT[4:7]]
    # 7 tokens: within every golden's sliding window, so nothing was overwritten yet.
    assert can_trim_prompt_cache(cache), name
    assert trim_prompt_cache(cache, 3) == 3
    assert all(c.offset == 4 for c in cache)
    again = model(mx.array([PROMPT[4:7]]), cache=cache)
    for i, logits in enumerate(first):
        assert mx.allclose(again[:, i], logits[:, 0], atol=2e-4).item(), name


def test_trim_refused_once_a_window_has_wrapped():
    model, _ = load_golden("mistral")  # every layer slides over 8 tokens
    cache = make_prompt_cache(model)
    assert all(isinstance(c, RotatingKVCache) for c in cache)
    model(mx.array([PROMPT[:12]]), cache=cache)
    assert not can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 2) == 0
    assert all(c.offset == 12 for c in cache)


@pytest.mark.parametrize("name", ["gemma3_text", "llama"])
def test_saved_prompt_cache_continues_identically(tmp_path, name):
    model, _ = load_golden(name)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:30]]), cache=cache)
    path = tmp_path / "turn.safetensors"
    save_prompt_cache(path, cache, {"model": name, "turns": "2"})
    loaded, meta = load_prompt_cache(path)
    assert meta == {"model": name, "turns": "2"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert [c.offset for c in loaded] == [c.offset for c in cache]
    for t in PROMPT[30:36]:
        a = model(mx.array([[t]]), cache=cache)
        b = model(mx.array([[t]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item(), name


def test_model_caches_match_layer_kinds():
    model, _ = load_golden("gemma3_text")  # sliding, full, sliding, full
    kinds = [type(c) for c in model.make_cache()]
    assert kinds == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    assert [c.max_size for c in model.make_cache() if isinstance(c, RotatingKVCache)] == [8, 8]


@pytest.mark.parametrize("name", ["phi3", "llama_dynamic"])
def test_a_chunked_prefill_rotates_as_one_pass_over_the_prompt(name):
    """Both goldens scale their RoPE past 16 tokens: 20 tokens in chunks of 8 end passes
    below that length, and must still rotate as transformers' one pass over all 20 does
    (20, not more: Phi-3's last token sees only its 10-token window)."""
    model, _ = load_golden(name)
    prompt = PROMPT[:20]
    whole = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
    cache = make_prompt_cache(model)
    prefill(model, mx.array(prompt[:-1]), cache, chunk=8, trailing=1)
    last = model(mx.array([prompt[-1:]]), cache=cache)[0, -1]
    assert mx.allclose(last, whole, atol=2e-4).item(), name
    assert all(r.pass_end == 0 for r in length_dependent_ropes(model))  # nothing left set for the steps


def test_a_length_dependent_model_reuses_its_cache_only_within_its_trained_length():
    model, _ = load_golden("llama_dynamic")  # rotations depend on the pass past 16 tokens
    chat = PrefixCache(model)

    def turn(n: int) -> int:
        keep = chat.reuse(PROMPT[:n])
        assert chat.cache is not None
        model(mx.array([PROMPT[keep:n]]), cache=chat.cache)
        assert chat.record(PROMPT[:n], PROMPT[:n])
        return keep

    assert turn(12) == 0
    assert turn(14) == 12  # every pass within 16 tokens: the prefix is exact to reuse
    assert turn(30) == 0  # past 16, one pass over the whole prompt rotates differently
    assert turn(10) == 0  # the cache's keys came from a pass past 16
    plain, _ = load_golden("llama")
    assert PrefixCache(plain).exact_until is None
