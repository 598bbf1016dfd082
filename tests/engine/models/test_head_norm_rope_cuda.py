"""The attention heads from the stacked q/k/v product in one CUDA kernel: per-head norms (where
the family has them) and RoPE of queries and keys, values moved (models.head_norm_rope_cuda).

Where MLX runs on CUDA, the kernel must give what ``mx.fast.rms_norm`` (where it norms) then
``mx.fast.rope`` give, to the rounding of the activations' dtype, and the values as they are, for heads of 64 and 128 features, float32,
float16 and bfloat16, a decode step, a verify pass and a batch step with one position per
sequence. Everywhere, the routing is checked: which attention modules it takes, and that
nothing routes while it is off or off CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.models import head_norm_rope_cuda as fused
from engine.models.base import Attention, RoPE, rotated_qkv

needs_cuda = pytest.mark.skipif(not fused.available(), reason="needs MLX's CUDA backend")


class ShiftedRoPE(RoPE):
    """A RoPE subclass (those pick settings by position, so they keep MLX's calls)."""


def _attention(head_dim=128, heads=(8, 2), dtype=mx.bfloat16, rope=None, norm_eps=1e-6):
    """Qwen3's attention (per-head norms); Llama's with ``norm_eps=None``."""
    nq, nkv = heads
    rope = rope or RoPE(head_dim, base=1_000_000.0)
    attn = Attention(nq * head_dim // 2, nq, nkv, head_dim, rope, qk_norm_eps=norm_eps)
    if norm_eps is not None:
        attn.q_norm.weight = (1 + 0.3 * mx.random.normal((head_dim,), key=mx.random.key(1))).astype(dtype)
        attn.k_norm.weight = (1 + 0.3 * mx.random.normal((head_dim,), key=mx.random.key(2))).astype(dtype)
    return attn


def _heads(attn, b, n, dtype=mx.bfloat16, seed=0):
    """A stacked q/k/v product [b, n, (nq + 2 nkv) * head_dim], as the kernel reads it."""
    width = (attn.n_heads + 2 * attn.n_kv_heads) * attn.head_dim
    return (3 * mx.random.normal((b, n, width), key=mx.random.key(seed))).astype(dtype)


@pytest.mark.parametrize("norm_eps", [1e-6, None], ids=["qwen3", "llama"])
def test_attention_at_decode_verify_and_batch_sizes_fits(norm_eps):
    attn = _attention(norm_eps=norm_eps)
    for b, n in [(1, 1), (1, 5), (8, 1), (16, 4)]:
        assert fused.fits(attn, _heads(attn, b, n), plain_rope=True)


@pytest.mark.parametrize(
    "change",
    ["rope subclass", "frequency table", "output scale", "partial rotation", "head of 96", "norm class", "a prompt"],
)
def test_what_the_kernel_does_not_compute_keeps_mlxs_calls(change):
    attn = _attention(head_dim=96 if change == "head of 96" else 128)
    plain_rope = change != "rope subclass"
    if change == "frequency table":
        attn.rope = RoPE(128, base=None, freqs=mx.ones((64,)))
    if change == "output scale":
        attn.rope = RoPE(128, base=10_000.0, out_scale=1.1)
    if change == "partial rotation":
        attn.rope = RoPE(64, base=10_000.0)
    if change == "norm class":
        attn.q_norm = nn.LayerNorm(128)
    rows = (1, fused.MAX_ROWS + 1) if change == "a prompt" else (1, 1)
    assert not fused.fits(attn, _heads(attn, *rows), plain_rope=plain_rope)


def test_the_kernel_is_off_when_asked_and_off_cuda(monkeypatch):
    monkeypatch.setenv(fused.ENV, "0")
    assert not fused.enabled()
    monkeypatch.delenv(fused.ENV)
    assert fused.enabled() == fused.available()


def _unfused(attn, y, offset):
    """MLX's calls: the split into heads, the norms where attn has them, RoPE."""
    nq, nkv = attn.n_heads, attn.n_kv_heads
    b, n, _ = y.shape
    q, k, v = mx.split(y.reshape(b, n, nq + 2 * nkv, attn.head_dim), [nq, nq + nkv], axis=2)
    if attn.qk_norm:
        q, k = (
            mx.fast.rms_norm(q, attn.q_norm.weight, attn.q_norm.eps),
            mx.fast.rms_norm(k, attn.k_norm.weight, attn.k_norm.eps),
        )
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    rope = attn.rope
    return (
        mx.fast.rope(q, rope.dims, traditional=False, base=rope.base, scale=rope.scale, offset=offset),
        mx.fast.rope(k, rope.dims, traditional=False, base=rope.base, scale=rope.scale, offset=offset),
        v,
    )


# Largest difference from MLX's two calls, relative to the largest magnitude: one rounding
# of the dtype (an ulp at the top of a bfloat16's range is 2^-7 of it, a float16's 2^-10).
TOLERANCE = {mx.float32: 1e-5, mx.float16: 2**-10, mx.bfloat16: 2**-7}


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("b, n, offset", [(1, 1, 517), (1, 5, "array"), (8, 1, "rows"), (2, 3, 0)])
@pytest.mark.parametrize("norm_eps", [1e-6, None], ids=["qwen3", "llama"])
def test_the_kernel_equals_mlxs_norm_then_rope(dtype, head_dim, b, n, offset, norm_eps):
    attn = _attention(head_dim=head_dim, heads=(16, 4), dtype=dtype, norm_eps=norm_eps)
    heads = _heads(attn, b, n, dtype, seed=b * 31 + n)
    if offset == "array":
        offset = mx.array(1_999, mx.int32)
    elif offset == "rows":
        offset = mx.array([3, 700, 0, 12, 4_095, 5, 6, 1_000], mx.int32)
    assert fused.fits(attn, heads, plain_rope=True)
    q, kv = fused.head_norm_rope(attn, heads, offset)
    k, v = kv  # keys and values stacked, as a KV cache of one buffer writes them
    q_ref, k_ref, v_ref = _unfused(attn, heads, offset)
    assert v.shape == v_ref.shape and mx.array_equal(v, v_ref)
    for got, ref in ((q, q_ref), (k, k_ref)):
        assert got.shape == ref.shape and got.dtype == ref.dtype == dtype
        size = mx.abs(ref.astype(mx.float32)).max().item()
        apart = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        assert apart <= TOLERANCE[dtype] * size, (apart, size)
        if dtype != mx.float32:  # float32 keeps the last bits of cos, sin and exp2, which differ
            same = (got == ref).astype(mx.float32).mean().item()
            assert same >= 0.99, same


@needs_cuda
@pytest.mark.parametrize("norm_eps", [1e-6, None], ids=["qwen3", "llama"])
def test_rotated_qkv_routes_through_the_kernel_and_keeps_its_values(monkeypatch, norm_eps):
    attn = _attention(norm_eps=norm_eps)
    y = _heads(attn, 1, 1)
    monkeypatch.setattr("engine.models.base.stacked_normed", lambda attn, names, x, norm: (y, x))
    calls = []
    kernel = fused.head_norm_rope
    monkeypatch.setattr(fused, "head_norm_rope", lambda *a: calls.append(1) or kernel(*a))
    routed = rotated_qkv(attn, mx.zeros((1, 1, 8)), mx.array(40, mx.int32))
    monkeypatch.setenv(fused.ENV, "0")
    plain = rotated_qkv(attn, mx.zeros((1, 1, 8)), mx.array(40, mx.int32))
    assert calls == [1]
    for got, ref in zip(routed, plain):
        assert got.shape == ref.shape
        assert mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= 2**-7 * 4
