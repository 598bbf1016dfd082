"""Decode attention split over the cached tokens on CUDA (models.decode_attention_cuda).

Where MLX runs on CUDA, the kernels must equal MLX's own attention for one-query steps and
causal verify passes, grouped heads, head sizes 64/128/256, float32/float16/bfloat16, short
and long caches, and keys read in place from a larger buffer; everywhere, only the passes
the kernels compute (causal, few queries, a short cache) may be routed to them."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.models import base
from engine.models import decode_attention_cuda as decode

needs_cuda = pytest.mark.skipif(not decode.shared.available(), reason="needs MLX's CUDA backend")


def _qkv(b, heads, kv_heads, n_q, n_keys, d, dtype, capacity=None, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((b, heads, n_q, d)).astype(dtype)
    buffer = mx.random.normal((2, b, kv_heads, capacity or n_keys, d)).astype(dtype)
    # Keys and values as the cache hands them over: views of one buffer, cut to the tokens held.
    return q, buffer[0, :, :, :n_keys], buffer[1, :, :, :n_keys]


def test_only_causal_passes_of_few_queries_over_a_short_cache_are_taken(monkeypatch):
    monkeypatch.setattr(decode, "enabled", lambda: True)
    q, k, v = _qkv(1, 32, 8, 1, 520, 128, mx.bfloat16)
    assert decode.takes(q, k, v, None)
    assert decode.takes(q, k, v, "causal")
    q5, k5, v5 = _qkv(1, 32, 8, 5, 520, 128, mx.bfloat16)
    assert decode.takes(q5, k5, v5, "causal")
    assert not decode.takes(q5, k5, v5, None)  # five queries with no mask see every key
    assert not decode.takes(q5, k5, v5, mx.ones((5, 520), mx.bool_))  # a window's mask
    q9, k9, v9 = _qkv(1, 32, 8, decode.MAX_QUERIES + 1, 520, 128, mx.bfloat16)
    assert not decode.takes(q9, k9, v9, "causal")
    ql, kl, vl = _qkv(1, 4, 2, 1, decode.MAX_KEYS + 1, 64, mx.bfloat16)
    assert not decode.takes(ql, kl, vl, None)
    qd, kd, vd = _qkv(1, 4, 2, 1, 64, 80, mx.bfloat16)
    assert not decode.takes(qd, kd, vd, None)  # not a multiple of 32 lanes
    assert not decode.takes(q, k.astype(mx.float16), v, None)  # mixed dtypes
    assert not decode.takes(mx.zeros((1, 30, 1, 128), mx.bfloat16), k, v, None)  # 30 heads over 8


def test_nothing_is_routed_unless_turned_on_where_the_kernels_can_run(monkeypatch):
    q, k, v = _qkv(1, 32, 8, 1, 520, 128, mx.bfloat16)
    monkeypatch.delenv(decode.ENV, raising=False)
    assert not decode.takes(q, k, v, None)  # off by default until measured
    monkeypatch.setenv(decode.ENV, "1")
    assert decode.takes(q, k, v, None) == (mx.cuda.is_available() and mx.default_device() == mx.gpu)


@pytest.fixture
def turned_on(monkeypatch):
    monkeypatch.setenv(decode.ENV, "1")


@needs_cuda
@pytest.mark.usefixtures("turned_on")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(
    "b, heads, kv_heads, n_q, n_keys, d, capacity",
    [
        (1, 32, 8, 1, 520, 128, 776),  # qwen3-4b's step, read from a larger buffer
        (1, 32, 8, 1, 1, 128, None),  # the first token
        (1, 32, 8, 5, 37, 128, 64),  # a verify pass
        (1, 32, 8, 8, 6000, 128, 6144),
        (2, 16, 16, 1, 300, 64, 320),  # no grouping, two rows
        (1, 8, 1, 4, 1000, 256, None),
        (1, 8, 2, 1, 33, 256, None),
        (3, 4, 2, 2, 129, 64, 200),
    ],
)
def test_the_kernels_equal_mlxs_attention(dtype, b, heads, kv_heads, n_q, n_keys, d, capacity):
    q, k, v = _qkv(b, heads, kv_heads, n_q, n_keys, d, dtype, capacity)
    mask = None if n_q == 1 else "causal"
    scale = d**-0.5
    assert decode.takes(q, k, v, mask)
    ours = decode.attend(q, k, v, scale)
    # float32 against MLX's CPU attention: its CUDA one is the less exact of the two there (on
    # an H100, 4e-5 to 1e-4 off the CPU's over 1,000-6,000 keys, where this kernel was 3e-7).
    where = mx.cpu if dtype == mx.float32 else None
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, stream=where)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    tol = {mx.bfloat16: 2e-2, mx.float16: 2e-3, mx.float32: 2e-6}[dtype]
    assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=tol, rtol=tol).item()


@needs_cuda
def test_a_model_step_routes_through_the_kernels_on_request(monkeypatch):
    q, k, v = _qkv(1, 32, 8, 1, 520, 128, mx.bfloat16)
    monkeypatch.setenv(decode.ENV, "1")
    routed = base.sdpa(q, k, v, 128**-0.5, None)
    monkeypatch.setenv(decode.ENV, "0")
    plain = base.sdpa(q, k, v, 128**-0.5, None)
    assert mx.allclose(routed.astype(mx.float32), plain.astype(mx.float32), atol=2e-2).item()


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    "b, heads, kv_heads, n_q, n_keys, d, capacity",
    [
        (1, 32, 8, 1, 520, 128, 1032),  # qwen3-4b's step in a buffer of the inside growth step
        (1, 32, 8, 5, 37, 128, 264),  # a verify pass over few keys: slices of one or two
        (1, 32, 8, 1, 9, 128, 1032),  # fewer keys than slices: some slices empty
        (2, 16, 16, 1, 300, 64, 320),
        (1, 8, 2, 1, 1, 128, 264),  # the first token
    ],
)
def test_the_counted_kernel_reads_only_the_counted_keys_of_a_whole_buffer(
    dtype, b, heads, kv_heads, n_q, n_keys, d, capacity
):
    """What a compiled step runs (``attend_counted``): the buffer's random keys past the
    count must not reach the result."""
    mx.random.seed(1)
    q = mx.random.normal((b, heads, n_q, d)).astype(dtype)
    buffer = mx.random.normal((2, b, kv_heads, capacity, d)).astype(dtype)
    mask = None if n_q == 1 else "causal"
    assert decode.fits(heads, kv_heads, n_q, n_keys, d, dtype, mask)
    ours = decode.attend_counted(q, buffer, mx.array([n_keys], mx.int32), d**-0.5)
    keys, values = buffer[0, :, :, :n_keys], buffer[1, :, :, :n_keys]
    where = mx.cpu if dtype == mx.float32 else None  # as above: the CPU's is the exact one
    theirs = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=mask, stream=where)
    tol = {mx.bfloat16: 2e-2, mx.float32: 2e-6}[dtype]
    assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=tol, rtol=tol).item()


@needs_cuda
def test_a_compiled_step_with_attention_inside_keeps_its_logits(monkeypatch):
    """qwen3-4b's layer shapes cut to two layers: one-token steps and a verify pass, with the
    split kernel inside the traced functions and with MLX's attention outside them."""
    from engine.decode.compiled_step import CompiledDecoder
    from engine.models.kv_cache import KVCache
    from tests.engine.models.test_qmv_cuda import _two_layer_qwen25

    model = _two_layer_qwen25(seed=11, shape="qwen3-4b")
    logits = {}
    for on in ("0", "1"):
        monkeypatch.setenv(decode.ENV, on)
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array([[11, 523, 9001]]), cache=cache))
        decoder = CompiledDecoder(model)
        assert decoder.prepare()
        logits[on] = [decoder(mx.array(t), cache) for t in ([4242], [77], [5, 6, 7])]
        assert decoder.traces == 2
        assert all((size[1] is not None) == (on == "1") for size in decoder._sizes)
    for ours, theirs in zip(logits["1"], logits["0"], strict=True):
        assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=0.1, rtol=0.05).item()
