"""The compiled decode step gives the plain forward pass's tokens and log-probs.

Driven by the tiny golden checkpoints, with small cache steps so a run crosses several
buffer growths, and windows of 8-10 tokens so rotating caches wrap many times.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, load_golden

from engine.cache import KVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache
from engine.fast_decode import compiled_decoder
from engine.generate import generate_step
from engine.models.base import RoPE

PROMPT = [(7 * i + 3) % 97 + 3 for i in range(13)]


def small_step_cache(model) -> list:
    """The model's own cache kinds, growing 4 tokens at a time."""
    cache = make_prompt_cache(model)
    out = []
    for c in cache:
        if isinstance(c, RotatingKVCache):
            out.append(RotatingKVCache(c.max_size, c.keep, step=4))
        else:
            out.append(KVCache(step=4))
    return out


def decode(model, prompt, cache, n, compiled):
    pairs = list(
        generate_step(mx.array(prompt, dtype=mx.uint32), model, cache, max_tokens=n, logprobs=True, compiled=compiled)
    )
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def compiled_applies(name: str) -> bool:
    model, _ = load_golden(name)
    return all(type(layer.self_attn.rope) is RoPE for layer in model.layers)


COMPILABLE = [f for f in FAMILIES if compiled_applies(f)]
# One of each kind of layer (plain, QK-norm, experts, sliding window, soft-capping):
# each new fused kernel costs the CPU build a C++ compile, so not every family.
SAMPLED = [f for f in ("llama", "qwen3", "qwen3_moe", "mistral", "gemma2") if f in COMPILABLE]


def test_most_families_take_the_compiled_step():
    # Every family but those whose RoPE depends on the position as a Python number.
    assert {"llama", "llama3_rope", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"} <= set(COMPILABLE)


@pytest.mark.parametrize("name", SAMPLED)
def test_compiled_decode_equals_plain_decode(name):
    model, _ = load_golden(name)
    ids_plain, lps_plain = decode(model, PROMPT, small_step_cache(model), 30, compiled=False)
    cache = small_step_cache(model)
    ids_fast, lps_fast = decode(model, PROMPT, cache, 30, compiled=True)
    assert ids_fast == ids_plain
    assert max(abs(a - b) for a, b in zip(lps_fast, lps_plain)) <= 1e-5
    # The compiled path really ran: the cache grew through it past several steps.
    assert cache[0].offset == len(PROMPT) + 29


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_one_compiled_step_matches_the_forward_pass(name):
    model, _ = load_golden(name)
    a, b = small_step_cache(model), small_step_cache(model)
    model(mx.array([PROMPT]), cache=a)
    model(mx.array([PROMPT]), cache=b)
    decoder = compiled_decoder(model)
    assert decoder is not None and decoder.prepare()
    for token in (5, 9, 11, 2, 40, 41, 7):  # several growths of a 4-token step
        fast = decoder(mx.array([token], dtype=mx.uint32), a)
        assert fast is not None
        plain = model(mx.array([[token]]), cache=b)[:, -1, :]
        assert mx.allclose(fast, plain, atol=1e-5, rtol=0).item()
        assert [c.offset for c in a] == [c.offset for c in b]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_compiled_decode_after_trim(name):
    model, _ = load_golden(name)
    results = []
    for compiled in (False, True):
        cache = small_step_cache(model)
        decode(model, PROMPT, cache, 12, compiled=compiled)
        if not trim_prompt_cache(cache, 6):
            pytest.skip("this cache cannot be trimmed once a window wrapped")
        results.append(decode(model, [17, 4], cache, 10, compiled=compiled))
    (ids_plain, lps_plain), (ids_fast, lps_fast) = results
    assert ids_fast == ids_plain
    assert max(abs(a - b) for a, b in zip(lps_fast, lps_plain)) <= 1e-5


def test_replaced_weights_are_picked_up():
    model, _ = load_golden("llama")
    decode(model, PROMPT, small_step_cache(model), 3, compiled=True)  # traces with the old weights
    head = model.lm_head.weight
    model.lm_head.weight = mx.flip(head, axis=0)  # a different but valid head
    ids_plain, lps_plain = decode(model, PROMPT, small_step_cache(model), 8, compiled=False)
    ids_fast, lps_fast = decode(model, PROMPT, small_step_cache(model), 8, compiled=True)
    assert ids_fast == ids_plain
    assert max(abs(a - b) for a, b in zip(lps_fast, lps_plain)) <= 1e-5


def test_unsupported_cases_fall_back():
    model, _ = load_golden("llama")
    decoder = compiled_decoder(model)
    decoder.prepare()
    # An empty cache has no buffers to write into: the plain pass takes that step.
    assert decoder(mx.array([3], dtype=mx.uint32), make_prompt_cache(model)) is None
    # A model without the decode pieces gets no decoder at all.
    assert compiled_decoder(object.__new__(type("Bare", (), {}))) is None


def test_switching_adapters_retraces_the_compiled_step(tmp_path):
    """Activating an adapter replaces no weight array, yet changes every step: the
    compiled decoder must follow, token for token with the plain path."""
    import json

    from engine.adapters import activate, deactivate, mount

    model, _ = load_golden("llama")
    weights, key = {}, mx.random.key(3)
    for i, layer in enumerate(model.layers):
        for proj in ("q_proj", "v_proj"):
            out_dim, in_dim = getattr(layer.self_attn, proj).weight.shape
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.self_attn.{proj}.lora_a"] = mx.random.normal((in_dim, 4), key=ka)
            weights[f"model.layers.{i}.self_attn.{proj}.lora_b"] = mx.random.normal((4, out_dim), key=kb)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": {"rank": 4, "scale": 4.0}}
    ))
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), weights)

    base_fast, _ = decode(model, PROMPT, small_step_cache(model), 12, compiled=True)
    mount(model, tmp_path, name="style")
    activate(model, {"style": 1.0})
    adapted_fast, adapted_lps = decode(model, PROMPT, small_step_cache(model), 12, compiled=True)
    adapted_plain, plain_lps = decode(model, PROMPT, small_step_cache(model), 12, compiled=False)
    assert adapted_fast == adapted_plain != base_fast
    assert max(abs(a - b) for a, b in zip(adapted_lps, plain_lps)) <= 1e-5
    deactivate(model)
    assert decode(model, PROMPT, small_step_cache(model), 12, compiled=True)[0] == base_fast
