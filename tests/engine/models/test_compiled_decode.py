"""The compiled decode step gives the plain forward pass's tokens and log-probs.

Driven by the tiny golden checkpoints, with small cache steps so a run crosses several
buffer growths, and windows of 8-10 tokens so rotating caches wrap many times.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, load_golden

from engine.decode.compiled_step import compiled_decoder
from engine.decode.loop import generate_step
from engine.models.base import RoPE
from engine.models.kv_cache import KVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

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
    # Hybrid families (recurrent layers without self_attn) decode through the plain pass.
    return all(type(getattr(getattr(layer, "self_attn", None), "rope", None)) is RoPE for layer in model.layers)


COMPILABLE = [f for f in FAMILIES if compiled_applies(f)]
# One of each kind of layer (plain, QK-norm, experts, sliding window, soft-capping):
# each new fused kernel costs the CPU build a C++ compile, so not every family.
SAMPLED = [f for f in ("llama", "qwen3", "qwen3_moe", "mistral", "gemma2") if f in COMPILABLE]


def test_most_families_take_the_compiled_step():
    # Every family but those whose RoPE depends on the position as a Python number.
    assert {"llama", "llama3_rope", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"} <= set(
        COMPILABLE
    )


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


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_few_tokens_at_once_match_the_forward_pass(name):
    """Speculative verification feeds several tokens per step: rows for each of them, and
    the cache left as the plain pass leaves it."""
    model, _ = load_golden(name)
    windows = [layer.window for layer in model.layers if getattr(layer, "window", None)]
    a, b = small_step_cache(model), small_step_cache(model)
    model(mx.array([PROMPT[:3]]), cache=a)
    model(mx.array([PROMPT[:3]]), cache=b)
    decoder = compiled_decoder(model)
    assert decoder is not None and decoder.prepare()
    compared = 0
    for tokens in ([5, 9, 11], [2], [40, 41, 7, 8, 30], [12, 13], [6]):
        ids = mx.array(tokens, dtype=mx.uint32)
        fast = decoder(ids, a)
        plain = model(ids[None], cache=b)[0]
        if fast is None:
            # Past a sliding window several queries need a boolean mask: the plain pass's job.
            assert len(tokens) > 1 and any(a[0].offset + len(tokens) > w for w in windows)
            model(ids[None], cache=a)
            continue
        compared += 1
        assert fast.shape == plain.shape == (len(tokens), plain.shape[-1])
        assert mx.allclose(fast, plain, atol=1e-5, rtol=0).item()
        assert [c.offset for c in a] == [c.offset for c in b]
    assert compared >= (5 if not windows else 3)


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


@pytest.mark.parametrize("change", ["new array", "new module"])
def test_an_added_array_or_replaced_module_is_picked_up(change):
    """Not only replaced arrays: a new array or a swapped module changes the step too."""
    model, _ = load_golden("llama")
    decode(model, PROMPT, small_step_cache(model), 3, compiled=True)
    layer = model.layers[1]
    if change == "new array":
        layer.mlp.down_proj.bias = mx.ones((layer.mlp.down_proj.weight.shape[0],))
    else:
        layer.post_attention_layernorm = type(layer.post_attention_layernorm)(
            layer.post_attention_layernorm.weight.size
        )
    ids_plain, lps_plain = decode(model, PROMPT, small_step_cache(model), 8, compiled=False)
    ids_fast, lps_fast = decode(model, PROMPT, small_step_cache(model), 8, compiled=True)
    assert ids_fast == ids_plain
    assert max(abs(a - b) for a, b in zip(lps_fast, lps_plain)) <= 1e-5


def test_a_prepared_decoder_does_not_keep_its_model_alive():
    """Unloading a model must free its weights at once, not at the next garbage collection."""
    import gc
    import weakref

    model, _ = load_golden("llama")
    decode(model, PROMPT, small_step_cache(model), 3, compiled=True)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


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

    from engine.models.lora import activate, deactivate, mount

    model, _ = load_golden("llama")
    weights, key = {}, mx.random.key(3)
    for i, layer in enumerate(model.layers):
        for proj in ("q_proj", "v_proj"):
            out_dim, in_dim = getattr(layer.self_attn, proj).weight.shape
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.self_attn.{proj}.lora_a"] = mx.random.normal((in_dim, 4), key=ka)
            weights[f"model.layers.{i}.self_attn.{proj}.lora_b"] = mx.random.normal((4, out_dim), key=kb)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": {"rank": 4, "scale": 4.0}}
        )
    )
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
