"""Gathered quantized expert products of a decode step (models.gathered_matmul_cuda).

Where MLX runs on CUDA, the kernel must equal ``mx.gather_qmm`` (rhs_indices, transpose=True)
to float rounding: a token's one row shared by its k experts (gate and up) and a row per
expert (down), one and several tokens, repeated experts, the last expert, every width and
dtype the kernel takes; a pair's output must not depend on the pairs beside it. Elsewhere
the routing is checked: which broadcasts it takes, and that the expert layer gives MLX's
result exactly where the kernel does not run.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.cli import bench_gather_qmm
from engine.models import gathered_matmul_cuda as gathered
from engine.models import quantized_matmul_cuda as qmv
from engine.models.switch import QuantizedSwitchLinear, SwitchGLU

needs_cuda = pytest.mark.skipif(not qmv.available(), reason="needs MLX's CUDA backend")


def test_which_broadcasts_of_rows_and_experts_the_kernel_takes():
    assert gathered.gather_shares((1, 1, 1), (1, 1, 8)) == 8  # one token's row, its 8 experts
    assert gathered.gather_shares((2, 3, 1), (2, 3, 6)) == 6  # every token's row, its 6 experts
    assert gathered.gather_shares((2, 3, 6), (2, 3, 6)) == 1  # a hidden row per expert (down)
    assert gathered.gather_shares((), (4,)) == 4
    assert gathered.gather_shares((12,), (12,)) == 1  # the sorted prompt layout
    assert gathered.gather_shares((2, 1), (2, 3, 6)) is None
    assert gathered.gather_shares((3, 6), (2, 3, 6)) is None


def test_expert_products_route_only_when_asked(monkeypatch):
    monkeypatch.delenv(gathered.GATHER_ENV, raising=False)
    monkeypatch.delenv(qmv.ENV, raising=False)
    assert not gathered.gathered_enabled()
    monkeypatch.setenv(gathered.GATHER_ENV, "1")
    assert gathered.gathered_enabled() == qmv.available()
    monkeypatch.setenv(qmv.ENV, "0")  # the kernel off turns its gathered use off too
    assert not gathered.gathered_enabled()


def test_decode_pairs_route_and_a_prompts_keep_mlxs_kernel():
    assert gathered.pays_gathered(8, 2048, 512) and gathered.pays_gathered(5 * 8, 2048, 512)
    assert not gathered.pays_gathered(gathered.MAX_PAIRS + 1, 2048, 512)


def _experts(experts, inputs, outputs, bits, group, dtype, seed):
    w = (mx.random.normal((experts, outputs, inputs), key=mx.random.key(seed)) * inputs**-0.5).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


def test_the_expert_layer_gives_mlxs_result_where_the_kernel_does_not_run(monkeypatch):
    """On the CPU build (or with the kernel off) the expert layers give ``mx.gather_qmm``'s
    output exactly, with and without a bias, for decode and prompt shapes."""
    if qmv.available():
        monkeypatch.setenv(qmv.ENV, "0")
    layer = QuantizedSwitchLinear(128, 48, 6, bias=True, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = _experts(6, 128, 48, 4, 64, mx.float32, 1)
    layer.bias = mx.random.normal((6, 48), key=mx.random.key(2))
    ids = mx.array([[[0, 5]], [[3, 3]]], dtype=mx.uint32)  # 2 tokens, 2 experts each
    x = mx.random.normal((2, 1, 1, 1, 128), key=mx.random.key(3))
    expected = mx.gather_qmm(
        x, layer.weight, layer.scales, layer.biases, rhs_indices=ids, transpose=True, group_size=64, bits=4
    )
    expected = expected + mx.expand_dims(layer.bias[ids], -2)
    assert mx.array_equal(layer(x, ids), expected)


def _gathered_case(tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype):
    seed = tokens * 131 + k * 17 + inputs + outputs + bits * 7 + group
    wq, scales, biases = _experts(experts, inputs, outputs, bits, group, dtype, seed)
    order = mx.argsort(mx.random.uniform(shape=(tokens, experts), key=mx.random.key(seed + 1)), axis=-1)
    ids = order[:, :k].astype(mx.uint32)
    ids = ids.reshape(tokens, 1, k) if shared_row else ids
    rows = (tokens, 1, 1, 1, inputs) if shared_row else (tokens, k, 1, inputs)
    x = mx.random.normal(rows, key=mx.random.key(seed + 2)).astype(dtype)
    return x, wq, scales, biases, ids


# tokens, k, experts, inputs, outputs, shared row, bits, group, dtype: the MoE families'
# decode shapes (qwen3.5-35b-a3b, moonlight, gemma4-26b-a4b), a verify pass, widths, dtypes,
# outputs not a multiple of a block's columns.
CASES = [
    (1, 8, 256, 2048, 512, True, 4, 64, mx.bfloat16),
    (1, 8, 256, 512, 2048, False, 4, 64, mx.bfloat16),
    (1, 6, 64, 2048, 1408, True, 4, 64, mx.bfloat16),
    (1, 6, 64, 1408, 2048, False, 4, 64, mx.bfloat16),
    (5, 8, 128, 2816, 704, True, 4, 64, mx.bfloat16),
    (3, 2, 8, 640, 37, False, 8, 128, mx.float16),
    (2, 4, 16, 256, 100, True, 8, 32, mx.float32),
    (4, 3, 5, 384, 20, False, 4, 128, mx.float16),
]
TOLERANCE = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}
APART = {mx.float32: 2e-3, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _referee(x, wq, scales, biases, ids, group, bits):
    with mx.stream(mx.cpu):
        return mx.gather_qmm(
            x.astype(mx.float32),
            wq,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            rhs_indices=ids,
            transpose=True,
            group_size=group,
            bits=bits,
        )


@needs_cuda
@pytest.mark.parametrize("tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype", CASES, ids=str)
def test_the_kernel_equals_mlxs_gather_qmm(tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype):
    x, wq, scales, biases, ids = _gathered_case(tokens, k, experts, inputs, outputs, shared_row, bits, group, dtype)
    shares = gathered.gather_shares(x.shape[:-2], ids.shape)
    assert shares == (k if shared_row else 1)
    got = gathered.gathered_matmul(x, wq, scales, biases, ids, shares, group, bits)
    mlx_own = mx.gather_qmm(x, wq, scales, biases, rhs_indices=ids, transpose=True, group_size=group, bits=bits)
    expected = _referee(x, wq, scales, biases, ids, group, bits)
    assert got.shape == mlx_own.shape and got.dtype == mlx_own.dtype == dtype
    size = mx.abs(expected).max().item()
    ours = mx.abs(got.astype(mx.float32) - expected).max().item()
    assert ours <= TOLERANCE[dtype] * size, (ours, size)
    apart = mx.abs(got.astype(mx.float32) - mlx_own.astype(mx.float32)).max().item()
    assert apart <= APART[dtype] * size, (apart, ours, size)


@needs_cuda
def test_repeated_and_last_experts_and_a_pairs_output_alone():
    x, wq, scales, biases, _ = _gathered_case(4, 3, 9, 512, 96, False, 4, 64, mx.bfloat16)
    ids = mx.array([[8, 8, 0], [1, 8, 1], [2, 3, 4], [8, 0, 8]], dtype=mx.uint32)
    many = gathered.gathered_matmul(x, wq, scales, biases, ids, 1, 64, 4)
    expected = _referee(x, wq, scales, biases, ids, 64, 4)
    assert mx.abs(many.astype(mx.float32) - expected).max().item() <= 8e-3 * mx.abs(expected).max().item()
    for t in (0, 3):
        one = gathered.gathered_matmul(x[t : t + 1], wq, scales, biases, ids[t : t + 1], 1, 64, 4)
        assert mx.array_equal(one[0], many[t])


@needs_cuda
def test_an_moe_blocks_decode_routes_through_the_kernel_and_keeps_its_output(monkeypatch):
    """A quantized SwitchGLU (gate, up, down) for one token and for a 3-token pass: every
    product runs the kernel, and the output stays MLX's to bfloat16 rounding."""
    mx.random.seed(5)
    block = SwitchGLU(256, 192, 16)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, group_size=64, bits=4)
    calls = []
    kernel = gathered.gathered_matmul
    monkeypatch.setattr(gathered, "gathered_matmul", lambda *a: calls.append(a[5]) or kernel(*a))
    for tokens in (1, 3):
        x = mx.random.normal((1, tokens, 256)).astype(mx.bfloat16)
        ids = mx.argsort(mx.random.uniform(shape=(1, tokens, 16)), axis=-1)[..., :4].astype(mx.uint32)
        monkeypatch.setenv(qmv.ENV, "0")
        plain = block(x, ids).astype(mx.float32)
        calls.clear()
        monkeypatch.setenv(qmv.ENV, "1")
        monkeypatch.setenv(gathered.GATHER_ENV, "1")
        routed = block(x, ids).astype(mx.float32)
        assert calls == [4, 4, 1]  # gate and up share a token's row across its 4 experts
        assert mx.abs(routed - plain).max().item() <= 3e-2 * mx.abs(plain).max().item()
    calls.clear()
    monkeypatch.setenv(gathered.GATHER_ENV, "0")  # expert products alone back to MLX's kernel
    assert mx.array_equal(block(x, ids), plain.astype(mx.bfloat16)) and not calls


def test_the_expert_microbench_times_every_product_against_its_floor(capsys):
    argv = [
        "--shape",
        "tiny-qwen3.5-moe",
        "--tokens",
        "1,2",
        "--calls",
        "2",
        "--repeat",
        "1",
        "--copy-mb",
        "16",
        "--json",
    ]
    assert bench_gather_qmm.main(argv) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (out["experts"], out["k"]) == (8, 2)
    for t in out["products"].values():
        assert set(t["single_us"]) == set(t["batched_us"]) == {"1", "2"}
        # 4-bit codes of a 64 -> 64 expert, one bf16 scale and bias per 64 inputs.
        assert t["bytes_per_expert"] == 64 * 64 // 2 + 2 * 64 * 2
        assert t["floor_bytes"]["1"] == 2 * t["bytes_per_expert"]
    assert bench_gather_qmm.main(["--tokens", "0"]) == 2
    assert bench_gather_qmm.main(["--tokens", "x"]) == 2
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.strip().splitlines())
