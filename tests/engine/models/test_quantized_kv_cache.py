"""The quantized KV cache: close to full precision, the same as mlx-lm's QuantizedKVCache, and
covered by prefix reuse, speculative decoding, saved caches, the memory plan and kv_config.json."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import GenerationParams, SamplingParams
from engine.errors import EngineError
from engine.models.kv_cache import KVCache, load_prompt_cache, save_prompt_cache
from engine.models.quantized_kv_cache import QuantizedKVCache, kv_layer_settings
from engine.runtime.host import ModelHost
from tests.tiny_models import make_tiny_llama

GREEDY = GenerationParams(max_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True, logprobs=True)
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    # Heads of 64: every group size but 128 fits along a head.
    return make_tiny_llama(tmp_path_factory.mktemp("kvq") / "tiny", hidden=128, heads=2, kv_heads=1, layers=2)


def _host(folder: Path, **kv) -> ModelHost:
    host = ModelHost()
    host.load(str(folder), **kv)
    return host


def _agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cache_stores_quantized_reads_close_trims_and_round_trips(tmp_path):
    mx.random.seed(0)
    keys, values = mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64))
    cache = QuantizedKVCache(bits=8, group_size=64, step=16)
    k, v = cache.update_and_fetch(keys[:, :, :30], values[:, :, :30])
    k, v = cache.update_and_fetch(keys[:, :, 30:], values[:, :, 30:])
    assert cache.offset == 40 and k.shape == keys.shape and v.dtype == values.dtype
    assert float(mx.abs(k - keys).max()) < 0.05 and float(mx.abs(v - values).max()) < 0.05
    plain = KVCache()
    plain.update_and_fetch(keys, values)
    assert cache.nbytes < 0.6 * plain.nbytes
    # Trim and refill gives what one pass gives.
    assert cache.trim(15) == 15
    k2, _ = cache.update_and_fetch(keys[:, :, 25:], values[:, :, 25:])
    assert mx.array_equal(k2, k)
    path = tmp_path / "q.safetensors"
    save_prompt_cache(path, [cache], {"x": "1"})
    (loaded,), meta = load_prompt_cache(path)
    assert isinstance(loaded, QuantizedKVCache) and loaded.offset == 40 and meta == {"x": "1"}
    k3, _ = loaded.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    k4, _ = cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    assert mx.array_equal(k3, k4)


def test_narrow_heads_pack_a_row_and_impossible_widths_refuse():
    keys = mx.random.normal((1, 4, 5, 8))  # stories260K's heads: 4 x 8 = one group of 32
    cache = QuantizedKVCache(bits=8, group_size=64)
    k, _ = cache.update_and_fetch(keys, keys)
    assert k.shape == keys.shape and float(mx.abs(k - keys).max()) < 0.05
    with pytest.raises(EngineError, match="full-precision"):
        QuantizedKVCache(bits=4).update_and_fetch(mx.zeros((1, 1, 2, 8)), mx.zeros((1, 1, 2, 8)))
    with pytest.raises(EngineError, match="4 or 8"):
        QuantizedKVCache(bits=3)


def _forced(host: ModelHost, ids: list[int], start: int) -> tuple[mx.array, mx.array]:
    """Teacher-forced: each next token's log-prob and the argmax, from ``start`` on."""
    from engine.models.kv_cache import make_prompt_cache

    logits = host.model(mx.array(ids)[None], make_prompt_cache(host.model))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    return chosen[start:], mx.argmax(logprobs[:-1], axis=-1)[start:]


# Per-token log-prob deltas against the full-precision cache along the full-precision greedy
# path (64 tokens, teacher-forced), and how often the argmax agrees. Measured on this model:
# 8-bit g64 max 0.024 / mean 0.009 / agree 1.0; 8-bit g32 0.018 / 0.005 / 0.98;
# 4-bit g64 0.37 / 0.08 / 0.83; 4-bit g32 0.30 / 0.08 / 0.75.
BOUNDS = {8: (0.05, 0.02, 0.95), 4: (0.6, 0.15, 0.7)}


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 32), (4, 64), (4, 32)])
def test_log_probs_stay_close_to_the_full_precision_cache(folder, bits, group):
    full = _host(folder)
    path = PROMPT + full.generate_ids(PROMPT, replace(GREEDY, max_tokens=64)).token_ids
    ref, ref_top = _forced(full, path, len(PROMPT) - 1)
    host = _host(folder, kv_bits=bits, kv_group_size=group)
    quant, top = _forced(host, path, len(PROMPT) - 1)
    delta = mx.abs(quant - ref)
    most, mean, agree = BOUNDS[bits]
    assert float(delta.max()) < most and float(delta.mean()) < mean
    assert float((top == ref_top).astype(mx.float32).mean()) >= agree
    host.generate_ids(PROMPT, GREEDY, session_id="s")
    assert all(isinstance(c, QuantizedKVCache) for c in host.session("s").cache)


def test_stories260k_8bit_keeps_the_published_greedy_sample(shared_data):
    """A real trained model: 8-bit KV keeps greedy decoding for the first 64 tokens (its
    heads of 8 pack four to a row of 32). Measured: the first 114 of 256 agree."""
    gguf = str(shared_data / "tiny_llm" / "stories260K.gguf")
    params = GenerationParams(max_tokens=64, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    full_host = _host(gguf)
    ids = full_host.encode_prompt("")
    full = full_host.generate_ids(ids, params)
    quant = _host(gguf, kv_bits=8).generate_ids(ids, params)
    assert quant.token_ids == full.token_ids


def test_prefix_reuse_and_speculative_decoding_match_the_plain_quantized_run(folder):
    host = _host(folder, kv_bits=8)
    first = host.generate_ids(PROMPT, GREEDY, session_id="a")
    follow = PROMPT + first.token_ids[:-1] + [60, 61, 62]
    cached = host.generate_ids(follow, GREEDY, session_id="a")
    assert cached.stats.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    fresh = _host(folder, kv_bits=8).generate_ids(follow, GREEDY, session_id="b")
    assert cached.token_ids == fresh.token_ids
    spec = GenerationParams(
        max_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True, speculative="ngram", ngram_size=2
    )
    drafted = _host(folder, kv_bits=8).generate_ids(follow, spec, session_id="c")
    assert drafted.stats.draft_tokens > 0
    assert drafted.token_ids == fresh.token_ids


def test_saved_cache_records_the_kv_setting(folder, tmp_path):
    path = str(tmp_path / "chat.safetensors")
    host = _host(folder, kv_bits=4, kv_group_size=32)
    first = host.generate_ids(PROMPT, GREEDY, session_id="a")
    assert host.save_session("a", path) > 0
    assert _host(folder).restore_session("a", path) == (0, "the saved cache was made with another kv")
    assert _host(folder, kv_bits=8).restore_session("a", path)[0] == 0
    again = _host(folder, kv_bits=4, kv_group_size=32)
    held = len(PROMPT) + len(first.token_ids) - 1
    assert again.restore_session("a", path) == (held, "")
    follow = PROMPT + first.token_ids[:-1] + [60, 61]
    restored = again.generate_ids(follow, GREEDY, session_id="a")
    plain = _host(folder, kv_bits=4, kv_group_size=32).generate_ids(follow, GREEDY, session_id="b")
    assert restored.stats.cached_tokens == held and restored.token_ids == plain.token_ids


def test_kv_config_json_sets_layers_and_the_plan_counts_it(folder, tmp_path):
    import shutil

    from engine.runtime.model_info import format_inspect, inspect_model

    plain_plan = inspect_model(folder).plan
    assert inspect_model(folder, kv_bits=8).plan.kv_bytes_per_token < 0.6 * plain_plan.kv_bytes_per_token
    mixed = Path(shutil.copytree(folder, tmp_path / "mixed"))
    (mixed / "kv_config.json").write_text(json.dumps({"group_size": 32, "layers": [{"bits": 8}, None]}))
    assert kv_layer_settings(mixed, 2) == [(8, 32), None]
    host = _host(mixed)
    cache = host.session("s").cache or []
    host.generate_ids(PROMPT, GREEDY, session_id="s")
    cache = host.session("s").cache
    assert isinstance(cache[0], QuantizedKVCache) and (cache[0].bits, cache[0].group_size) == (8, 32)
    assert type(cache[1]) is KVCache
    info = inspect_model(mixed)
    assert info.kv_cache.startswith("per layer") and "cache held at" in format_inspect(info)
    assert plain_plan.kv_bytes_per_token > info.plan.kv_bytes_per_token > 0.6 * plain_plan.kv_bytes_per_token
    assert host.info.kv_cache == info.kv_cache and host.info.plan.kv_bytes_per_token == info.plan.kv_bytes_per_token
    (mixed / "kv_config.json").write_text(json.dumps({"layers": [{"bits": 3}, None]}))
    with pytest.raises(EngineError, match="4 or 8"):
        _host(mixed)


def test_same_greedy_ids_as_mlx_lms_quantized_kv_cache(folder):
    """mlx-lm attends over its packed codes with quantized matmuls; we do so on Metal and
    dequantize elsewhere. The stored codes are the same, so greedy ids agree and log-probs
    stay within 2e-3."""
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache as TheirCache

    model, _ = mlx_lm.load(str(folder))
    theirs, their_lp = [], []
    cache = [TheirCache(group_size=64, bits=8) for _ in model.layers]
    for (token, logprobs), _ in zip(generate_step(mx.array(PROMPT), model, prompt_cache=cache), range(24)):
        theirs.append(int(token))
        their_lp.append(float(logprobs[int(token)]))
    ours = _host(folder, kv_bits=8, kv_group_size=64).generate_ids(PROMPT, GREEDY)
    n = _agree(theirs, ours.token_ids)
    assert n >= 20
    assert max(abs(a - b) for a, b in zip(their_lp[:n], ours.token_logprobs[:n])) < 2e-3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_queries", [1, 5])
def test_attending_over_the_codes_equals_attending_over_the_dequantized_cache(bits, n_queries):
    """A short pass reads the codes with quantized matmuls instead of dequantizing the whole
    cache first: the same attention, up to float rounding (queries of 4 heads over 2 KV heads)."""
    key = mx.random.key(3)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    cache = QuantizedKVCache(bits=bits, group_size=32)
    keys, values = mx.random.normal((1, 2, 40, 64), key=k1), mx.random.normal((1, 2, 40, 64), key=k2)
    assert cache.attends_quantized(keys, values)
    cache.store(keys, values)
    cache.trim(7)  # trimmed tokens stay in the buffer past the offset: they must not be read
    new_k, new_v = mx.random.normal((1, 2, n_queries, 64), key=k3), mx.random.normal((1, 2, n_queries, 64), key=k4)
    queries = mx.random.normal((1, 4, n_queries, 64), key=k5)
    mask = cache.make_mask(n_queries)
    full_k, full_v = cache.update_and_fetch(new_k, new_v)
    expected = mx.fast.scaled_dot_product_attention(queries, full_k, full_v, scale=0.125, mask=mask)
    got = cache.attend(queries, 0.125, mask)
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() < 1e-4


def test_decode_steps_read_the_quantized_cache_without_dequantizing_it(folder, monkeypatch):
    """Where the codes are read (Metal: forced here), each decode step attends through
    ``QuantizedKVCache.attend``; only the prompt's pass dequantizes (for the fast kernel)."""
    from engine.models import quantized_kv_cache

    monkeypatch.setattr(quantized_kv_cache, "READS_CODES", True)
    calls = {"attend": 0, "fetch": 0}
    attend, fetch = QuantizedKVCache.attend, QuantizedKVCache.update_and_fetch

    def counted_attend(self, *a, **k):
        calls["attend"] += 1
        return attend(self, *a, **k)

    def counted_fetch(self, *a, **k):
        calls["fetch"] += 1
        return fetch(self, *a, **k)

    monkeypatch.setattr(QuantizedKVCache, "attend", counted_attend)
    monkeypatch.setattr(QuantizedKVCache, "update_and_fetch", counted_fetch)
    host = _host(folder, kv_bits=8, kv_group_size=64)
    host.generate_ids(PROMPT * 4, replace(GREEDY, max_tokens=6))
    layers = 2
    assert calls["fetch"] == layers  # the 48-token prompt, once per layer
    assert calls["attend"] >= 5 * layers
