"""Decoding latent-attention models: the compiled step by default, kept exact, and the plain pass.

Latent attention decodes through the compiled step (``LatentAttention.compiled_decode``),
which hands the query parts to attention as a pair; with the first query projection and
``kv_a_proj_with_mqa`` stacked into one matmul for a few rows, also when a layer opts out
of the step (the plain pass then uses the stacks). The router
holds its weight in float32, and absorbed attention is composed in a few kernels where
MLX has no fused one. Each must leave tokens and log-probs as they were, with and
without a query LoRA, biased or not, in float32 and in mlx-lm's 4-bit layout.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from model_goldens import GOLDEN, load_golden

from engine.decode.compiled_step import compiled_decoder
from engine.decode.loop import generate_step
from engine.models.mla import LatentAttention
from engine.models.routed_moe import GroupLimitedRouter, _route
from engine.models.stacked import stacked_output

MLX_LAYOUTS = GOLDEN.parent / "mlx_layouts"


def _both(model, prompt: list[int], n: int = 10):
    def run(compiled: bool):
        pairs = list(
            generate_step(
                mx.array(prompt, dtype=mx.uint32),
                model,
                model.make_cache(),
                max_tokens=n,
                logprobs=True,
                compiled=compiled,
            )
        )
        return [t for t, _ in pairs], [lp for _, lp in pairs]

    return run(False), run(True)


def _assert_stacked(model) -> None:
    """Every latent attention layer computes its two input projections in one matmul."""
    x = mx.zeros((1, 1, model.args.hidden_size), dtype=mx.float32)
    for layer in model.layers:
        attn = layer.self_attn
        first = "q_proj" if attn.q_lora_rank is None else "q_a_proj"
        both = stacked_output(attn, (first, "kv_a_proj_with_mqa"), x.astype(attn.kv_a_proj_with_mqa(x).dtype))
        assert both is not None
        assert both.shape[-1] == getattr(attn, first)(x).shape[-1] + attn.kv_lora_rank + attn.rope_dims


@pytest.mark.parametrize("name", ["moonlight", "kimi_k2", "deepseek_v3"])
def test_opting_out_of_the_compiled_step_keeps_stacked_projections(name, monkeypatch):
    """moonlight: no query LoRA; kimi_k2: a query LoRA; deepseek_v3: biased projections."""
    monkeypatch.setattr(LatentAttention, "compiled_decode", False)
    model, expected = load_golden(name)
    unstacked = list(
        generate_step(
            mx.array(expected["prompt_ids"], dtype=mx.uint32),
            model,
            model.make_cache(),
            max_tokens=8,
            logprobs=True,
            compiled=False,
        )
    )
    decoder = compiled_decoder(model)
    assert decoder is not None and not decoder.prepare()  # no compiled step, but stacked
    _assert_stacked(model)
    stacked = list(
        generate_step(
            mx.array(expected["prompt_ids"], dtype=mx.uint32), model, model.make_cache(), max_tokens=8, logprobs=True
        )
    )
    assert [t for t, _ in stacked] == [t for t, _ in unstacked] == expected["greedy_ids"][:8]
    assert max(abs(a[1] - b[1]) for a, b in zip(stacked, unstacked)) < 1e-5


@pytest.mark.parametrize("name", ["moonlight", "kimi_k2", "deepseek_v3"])
def test_compiled_step_by_default_equals_plain_pass(name):
    model, expected = load_golden(name)
    assert compiled_decoder(model).prepare()
    _assert_stacked(model)
    (plain_ids, plain_lp), (fast_ids, fast_lp) = _both(model, expected["prompt_ids"])
    assert plain_ids == fast_ids == expected["greedy_ids"][: len(plain_ids)]
    assert max(abs(a - b) for a, b in zip(plain_lp, fast_lp)) < 1e-5


def test_compiled_step_equals_plain_pass_in_mlx_lm_4bit_layout():
    from engine.runtime.loading import load_model

    folder = MLX_LAYOUTS / "moonlight"
    model = load_model(folder, memory_budget=10**9).model
    expected = json.loads((folder / "expected.json").read_text())
    assert compiled_decoder(model).prepare()
    _assert_stacked(model)
    (plain_ids, plain_lp), (fast_ids, fast_lp) = _both(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert plain_ids == fast_ids == expected["greedy_ids"]
    assert max(abs(a - b) for a, b in zip(plain_lp, fast_lp)) < 1e-5


def test_router_holds_float32_and_routes_as_a_cast_per_call_did():
    model, _ = load_golden("kimi_k2")
    router = next(m.mlp.gate for m in model.layers if isinstance(getattr(m.mlp, "gate", None), GroupLimitedRouter))
    bf16 = router.weight.astype(mx.bfloat16)
    router.weight = bf16  # as a bf16 checkpoint hands it over
    assert router.weight.dtype == mx.float32
    router.set_dtype(mx.bfloat16)  # as casting a whole model does
    assert router.weight.dtype == mx.float32 and router.e_score_correction_bias.dtype == mx.bfloat16
    x = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(0)).astype(mx.bfloat16)
    settings = (router.top_k, router.n_group, router.topk_group, router.norm_topk_prob, router.scaling)
    chosen, weights = router(x)
    before_chosen, before_weights = _route(x, bf16, router.e_score_correction_bias, *settings)
    assert mx.array_equal(chosen, before_chosen).item() and mx.array_equal(weights, before_weights).item()


def test_compiled_verification_of_a_few_tokens_equals_the_plain_pass():
    """Speculative verification feeds a few tokens at once: the causal mask then applies
    to the query pair."""
    model, expected = load_golden("kimi_k2")
    decoder = compiled_decoder(model)
    assert decoder.prepare()
    prompt = mx.array([expected["prompt_ids"]])
    drafts = mx.array([3, 14, 15, 92])
    plain_cache, fast_cache = model.make_cache(), model.make_cache()
    model(prompt, cache=plain_cache)
    model(prompt, cache=fast_cache)
    plain = model(drafts[None], cache=plain_cache)[0]
    fast = decoder(drafts, fast_cache)
    assert fast is not None and fast.shape == plain.shape
    assert mx.allclose(fast, plain, atol=1e-5, rtol=0).item()


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("n_queries", [1, 5])
def test_composed_absorbed_attention_equals_the_fused_call(n_queries, scaled, monkeypatch):
    """The few-kernel absorbed attention computes what MLX's fused call computes, causal
    mask included (several queries: speculative verification), whether the RoPE queries
    come scaled or not."""
    from engine.models.mla import causal_keep

    model, _ = load_golden("moonlight")
    attn = model.layers[0].self_attn
    heads, keys = attn.n_heads, 37
    k = iter(mx.random.split(mx.random.key(3), 4))
    q_latent = mx.random.normal((1, heads, n_queries, attn.kv_lora_rank), key=next(k))
    q_pe = mx.random.normal((1, heads, n_queries, attn.rope_dims), key=next(k))
    latent = mx.random.normal((1, 1, keys, attn.kv_lora_rank), key=next(k))
    k_pe = mx.random.normal((1, 1, keys, attn.rope_dims), key=next(k))
    keep = causal_keep("causal" if n_queries > 1 else None, n_queries, keys)

    def run(composed: bool) -> mx.array:
        monkeypatch.setattr("engine.models.mla.composed_latent_attention", lambda: composed)
        return attn.latent_attention(q_latent, q_pe * attn.scale if scaled else q_pe, latent, k_pe, keep, scaled)

    fused, composed = run(False), run(True)
    assert composed.shape == fused.shape == (1, heads, n_queries, attn.kv_lora_rank)
    assert mx.allclose(composed, fused, atol=1e-5, rtol=1e-5).item()


def test_a_stack_is_set_aside_once_a_layer_gains_an_array():
    """The per-call check that a stack still holds is a few lookups; an array added to one
    of its layers (a bias) still sets it aside."""
    from engine.models.base import GATE_UP, GatedMLP
    from engine.models.stacked import project, stack_projections

    mlp = GatedMLP(32, 48)
    mx.eval(mlp.parameters())
    assert stack_projections(mlp) == 1
    x = mx.random.normal((1, 1, 32), key=mx.random.key(5))
    assert stacked_output(mlp, GATE_UP, x) is not None
    mlp.gate_proj.bias = mx.ones((48,))
    assert stacked_output(mlp, GATE_UP, x) is None
    gate, _ = project(mlp, GATE_UP, x)
    assert (
        mx.allclose(gate, mlp.gate_proj(x)).item()
        and mx.allclose(gate - 1, x @ mlp.gate_proj.weight.T, atol=1e-6).item()
    )
