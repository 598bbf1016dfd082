"""Caches driven by real (tiny golden) models: chunked prefill, trim, save/load."""

from __future__ import annotations

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, load_golden

from engine.models.kv_cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

# Phi-3's LongRoPE and "dynamic" RoPE pick frequencies from the length of each forward
# pass (as transformers does), so chunked and whole prefills differ there by design.
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
