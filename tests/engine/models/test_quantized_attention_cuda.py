"""The fused CUDA attention over a quantized KV cache (models.quantized_attention_cuda).

Where MLX runs on CUDA, the kernels must equal attention over the dequantized cache, for
decode steps and verify passes, grouped heads, both bit widths, every group size, head
sizes 64/128/256 and float32/float16/bfloat16; elsewhere only the routing is checked."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.models import quantized_attention_cuda as fused
from engine.models.quantized_kv_cache import QuantizedKVCache

needs_cuda = pytest.mark.skipif(not fused.available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize(
    "lanes, rows, dim",
    [(8, 4, 128), (16, 8, 128), (32, 16, 128), (8, 4, 64), (8, 1, 256), (8, 2, 256)],
)
def test_lane_groups_keep_each_lanes_running_sums_within_its_registers(lanes, rows, dim):
    assert fused._lanes_per_key(rows, dim) == lanes
    assert rows * dim // lanes <= fused.LANE_ROW_FLOATS


@pytest.mark.parametrize("rows, per_block", [(1, 1), (4, 4), (8, 8), (16, 8), (20, 5), (12, 6), (40, 8), (11, 1)])
def test_rows_beyond_a_block_split_evenly_across_blocks(rows, per_block):
    assert fused._rows_per_block(rows) == per_block


def test_only_plain_causal_passes_that_fit_take_the_fused_kernels():
    groups = (64, 64)
    assert fused.fits(32, 8, 1, 128, groups, None)
    assert fused.fits(32, 8, 4, 128, groups, "causal")
    assert fused.fits(32, 8, 5, 128, groups, "causal")  # 20 rows: four blocks of 5 per KV head
    assert not fused.fits(32, 8, 2, 128, groups, mx.ones((2, 10), mx.bool_))  # a window's mask
    assert not fused.fits(32, 8, 1, 80, groups, None)  # not a multiple of 32 lanes
    assert not fused.fits(4, 4, 1, 256, (4, 4), None)  # a lane's dimensions would span groups


CASES = [
    # batch, query heads, KV heads, queries, head dim, tokens, bits, group, dtype
    (1, 32, 8, 1, 128, 1000, 8, 64, mx.bfloat16),
    (1, 32, 8, 1, 128, 33000, 4, 64, mx.bfloat16),
    (1, 32, 8, 3, 128, 777, 8, 32, mx.bfloat16),
    (1, 32, 8, 4, 128, 2000, 4, 64, mx.bfloat16),
    (1, 32, 4, 1, 128, 3000, 8, 64, mx.bfloat16),
    (1, 32, 4, 2, 128, 3001, 8, 32, mx.float32),
    (1, 16, 16, 4, 64, 300, 4, 64, mx.float16),
    (2, 8, 2, 2, 128, 129, 8, 128, mx.float32),
    (1, 4, 4, 1, 256, 70, 4, 32, mx.bfloat16),
    (1, 32, 8, 2, 128, 5, 8, 64, mx.bfloat16),
    (1, 32, 8, 5, 128, 1500, 8, 64, mx.bfloat16),  # 20 rows: 4 blocks of 5 per KV head
    (1, 32, 8, 8, 128, 600, 4, 32, mx.float32),  # 32 rows: 4 blocks of 8
    (2, 12, 4, 3, 64, 400, 8, 64, mx.float16),  # 9 rows: 3 blocks of 3
]


@needs_cuda
@pytest.mark.parametrize("batch, heads, kv_heads, n_q, dim, tokens, bits, group, dtype", CASES)
def test_fused_attention_equals_attention_over_the_dequantized_cache(
    batch, heads, kv_heads, n_q, dim, tokens, bits, group, dtype
):
    k1, k2, k3 = mx.random.split(mx.random.key(tokens), 3)
    keys = mx.random.normal((batch, kv_heads, tokens, dim), key=k1).astype(dtype)
    values = mx.random.normal((batch, kv_heads, tokens, dim), key=k2).astype(dtype)
    queries = mx.random.normal((batch, heads, n_q, dim), key=k3).astype(dtype)
    cache = QuantizedKVCache(bits, group)
    cache.store(keys[:, :, : tokens - n_q], values[:, :, : tokens - n_q])
    cache.store(keys[:, :, tokens - n_q :], values[:, :, tokens - n_q :])  # the pass's own keys
    mask = None if n_q == 1 else "causal"
    dequantized = [
        cache._read(t, g, 0, cache.offset).astype(mx.float32)
        for t, g in ((cache.keys, cache._groups[0]), (cache.values, cache._groups[1]))
    ]
    # The referee runs on the CPU: the GPU's float32 attention over several queries may
    # take TF32 tensor-core paths, which round at ~1e-3.
    with mx.stream(mx.cpu):
        expected = mx.fast.scaled_dot_product_attention(
            queries.astype(mx.float32), *dequantized, scale=dim**-0.5, mask=mask
        )
    assert fused.fits(heads, kv_heads, n_q, dim, cache._groups, mask)
    got = cache.attend(queries, dim**-0.5, mask)  # routes to the fused kernels on CUDA
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.abs(got.astype(mx.float32) - expected).max().item() < tolerance
