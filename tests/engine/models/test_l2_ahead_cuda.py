"""The next products' weights asked into L2 during a decode step's attention
(models.l2_ahead_cuda): which arrays a layer names, in what order, and only when asked; on the
GPU, that the kernel hands the queries on unchanged and a compiled step's logits do not move."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.models import l2_ahead_cuda as l2
from tests.engine.models.test_qmv_cuda import _compiled_verify_logits, _two_layer_qwen25

needs_cuda = pytest.mark.skipif(not l2.available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("value, level", [("", 0), ("0", 0), ("x", 0), ("3", 0), ("1", 1), ("2", 2)])
def test_the_prefetch_is_asked_for_by_level(monkeypatch, value, level):
    monkeypatch.setenv(l2.ENV, value)
    assert l2.level() == level


def test_a_layer_names_the_products_after_attention_in_their_order(monkeypatch):
    """The output product's weight, scales and biases, then the stacked gate/up product's; the
    down product's too at level 2; nothing for a layer whose gate and up are not stacked."""
    model = _two_layer_qwen25(seed=5, vocab_size=256)  # the head plays no part here
    layer = model.layers[1]
    x = mx.zeros((1, 1, layer.self_attn.o_proj.weight.shape[0]), mx.bfloat16)
    o, down = layer.self_attn.o_proj, layer.mlp.down_proj
    monkeypatch.setenv(l2.ENV, "1")
    arrays = layer.weights_after_attention(x)
    assert len(arrays) == 6
    assert all(a is b for a, b in zip(arrays[:3], (o.weight, o.scales, o.biases), strict=True))
    gate_up = arrays[3]
    assert gate_up.shape == (2 * down.weight.shape[1] * 8, o.weight.shape[0] // 8)
    monkeypatch.setenv(l2.ENV, "2")
    arrays = layer.weights_after_attention(x)
    assert all(a is b for a, b in zip(arrays[6:], (down.weight, down.scales, down.biases), strict=True))
    layer.mlp._stacks.by_names.clear()
    assert layer.weights_after_attention(x) == []


@pytest.mark.parametrize("in_heads, taken", [("1", 2), ("", 2), ("0", 0)])
def test_arrays_offered_are_taken_once_or_left_for_the_standalone_kernel(monkeypatch, in_heads, taken):
    monkeypatch.setenv(l2.IN_HEADS_ENV, in_heads)
    arrays = [mx.zeros(4), mx.ones(4)]
    with l2.asking(arrays):
        assert len(l2.take()) == taken
        assert len(l2.left()) == 2 - taken
        assert l2.take() == [] or not taken
    assert l2.left() == []


@needs_cuda
@pytest.mark.parametrize("count", [1, 6, 9])
def test_the_kernel_hands_the_queries_on_unchanged(count):
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    arrays = [mx.arange(1000 * (i + 1) + 3, dtype=mx.uint32) for i in range(count)]
    assert mx.array_equal(l2.ahead(q, arrays), q)


@needs_cuda
@pytest.mark.parametrize("in_heads", ["1", "0"])
def test_a_compiled_step_keeps_its_logits_with_the_prefetch(monkeypatch, in_heads):
    """In the heads kernel's launch or in its own, asking for two or three products' weights."""
    monkeypatch.setenv(l2.IN_HEADS_ENV, in_heads)
    model = _two_layer_qwen25(seed=7, shape="qwen3-4b")
    calls = []
    logits = {v: _compiled_verify_logits(monkeypatch, model, l2.ENV, v, calls) for v in ("0", "1", "2")}
    assert mx.array_equal(logits["0"], logits["1"]) and mx.array_equal(logits["0"], logits["2"])
