"""The tensor-core quantized matmul kernel for CUDA (models.quantized_mma_cuda).

Where MLX runs on CUDA, the kernel must equal ``mx.quantized_matmul`` (transpose=True) to
float rounding for 4-bit weights in groups of 32/64/128, float16 and bfloat16, 1-16 rows,
output counts that are not a multiple of its 16-column tile and K-splits of 1 to 8 warps;
a row's output must not depend on the rows beside it. Its primitives' assembly (the MMA, the
codes' conversion) is checked here; the body's arithmetic is checked on the CPU too
(test_qmv_mma_emulated.py). Elsewhere only the routing is checked.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.models import quantized_matmul_cuda as qmv
from engine.models import quantized_mma_cuda as mma

needs_cuda = pytest.mark.skipif(not qmv.available(), reason="needs MLX's CUDA backend")


def _fits(rows=8, bits=4, group_size=64, dtype=mx.bfloat16, inputs=2560, outputs=4096):
    return mma.fits(
        rows,
        inputs,
        outputs,
        bits=bits,
        group_size=group_size,
        mode="affine",
        dtype=dtype,
        scales_dtype=dtype,
        has_biases=True,
    )


def test_the_kernel_takes_4_bit_half_precision_products_of_up_to_16_rows():
    assert all(_fits(rows=r, group_size=g, dtype=d) for r in (1, 8, 16) for g in (32, 64, 128) for d in mma.DTYPES)
    assert not _fits(bits=8) and not _fits(dtype=mx.float32) and not _fits(rows=17)
    assert not _fits(inputs=100, group_size=64)


def test_it_is_on_wherever_the_row_kernel_is_unless_turned_off(monkeypatch):
    monkeypatch.delenv(mma.ENV, raising=False)
    assert mma.switched_on() == qmv.available()
    monkeypatch.setenv(mma.ENV, "0")
    assert not mma.switched_on()


def _product(rows, inputs, outputs, group, dtype, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed + rows + inputs + outputs), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=4)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    return x, wq, scales, biases


def _referee(x, wq, scales, biases, group):
    with mx.stream(mx.cpu):
        f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
        return mx.quantized_matmul(f32[0], wq, f32[1], f32[2], transpose=True, group_size=group, bits=4)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("rows", [8, 13, 16])
def test_the_epilogues_are_the_separate_ops_bit_for_bit(dtype, rows):
    """The residual add and silu(gate) * up in the kernel's epilogue equal the product
    followed by MLX's ops, on a K-split matrix (down-like) and a wide one (first here: the
    exactness cases below build a kernel each and take minutes)."""
    for inputs, outputs in ((9728, 1280), (2560, 4864)):
        x, wq, scales, biases = _product(rows, inputs, 2 * outputs, 64, dtype)
        plain = mma.matmul(x, wq, scales, biases, 64)
        residual = (4 * mx.random.normal(plain.shape, key=mx.random.key(rows))).astype(dtype)
        assert mx.array_equal(mma.matmul(x, wq, scales, biases, 64, residual=residual), residual + plain)
        gate, up = mx.split(plain, 2, axis=-1)
        fused = mma.matmul(x, wq, scales, biases, 64, glu=True)
        assert fused.shape == (rows, outputs)
        assert mx.array_equal(fused, nn.silu(gate) * up)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("inputs, outputs", [(512, 37), (2560, 1000), (9728, 2560)])
def test_the_kernel_computes_mlxs_product(rows, group, dtype, inputs, outputs):
    """As close to a float32 product as MLX's own kernel is (both round to the dtype)."""
    x, wq, scales, biases = _product(rows, inputs, outputs, group, dtype)
    got = mma.matmul(x, wq, scales, biases, group)
    theirs = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=4)
    exact = _referee(x, wq, scales, biases, group)
    assert got.shape == theirs.shape and got.dtype == dtype
    ours_off = mx.abs(got.astype(mx.float32) - exact).max().item()
    theirs_off = mx.abs(theirs.astype(mx.float32) - exact).max().item()
    size = mx.abs(exact).max().item()
    assert ours_off <= max(1.5 * theirs_off, 2**-8 * size), (ours_off, theirs_off, size)


@needs_cuda
def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    x, wq, scales, biases = _product(16, 2560, 4096, 64, mx.bfloat16, seed=9)
    many = mma.matmul(x, wq, scales, biases, 64)
    for rows in (1, 3, 8, 11):
        assert mx.array_equal(mma.matmul(x[:rows], wq, scales, biases, 64), many[:rows]), rows


@needs_cuda
def test_a_models_products_of_8_rows_run_it_and_keep_its_logits(monkeypatch):
    """A 4-bit qwen2.5-0.5b-shaped model, an 8-token pass: by default every projection (stacked
    q/k/v, o, gate/up, down, the tied head) runs it, and the logits stay those of MLX's kernel
    to bfloat16 rounding."""
    from tests.engine.models.test_qmv_cuda import _two_layer_qwen25

    model = _two_layer_qwen25(seed=4)
    tokens = mx.array([[11, 523, 9001, 77, 4242, 5, 6000, 123]])
    monkeypatch.setenv(qmv.ENV, "0")
    plain = model(tokens).astype(mx.float32)
    calls = []
    kernel = mma.matmul
    monkeypatch.setattr(mma, "matmul", lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))
    monkeypatch.setenv(qmv.ENV, "1")
    monkeypatch.delenv(mma.ENV, raising=False)
    routed = model(tokens).astype(mx.float32)
    assert len(calls) == 2 * 4 + 1
    assert mx.abs(routed - plain).max().item() <= 5e-2 * mx.abs(plain).max().item()


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_codes_unpacked_with_one_logic_op_give_the_same_bits(monkeypatch, dtype, rows):
    x, wq, scales, biases = _product(rows, 2560, 1030, 64, dtype)
    plain = mma.matmul(x, wq, scales, biases, 64, 4)
    monkeypatch.setenv(qmv.ONE_OP_ENV, "1")
    assert mx.array_equal(mma.matmul(x, wq, scales, biases, 64, 4), plain)


@needs_cuda
@pytest.mark.parametrize("rows, glu", [(1, True), (1, False), (4, True)])
def test_the_norm_prologue_is_mlxs_rms_norm_then_the_product(rows, glu):
    """As the row kernel's prologue: its squares are summed in another order than MLX's norm,
    so a normed value may part by a rounding, almost never."""
    x, wq, scales, biases = _product(rows, 2560, 2060 if glu else 1030, 64, mx.bfloat16)
    weight = (1 + 0.3 * mx.random.normal((2560,), key=mx.random.key(5))).astype(mx.bfloat16)
    got = mma.matmul(x, wq, scales, biases, 64, 4, glu=glu, norm=(weight, 1e-6))
    expected = mma.matmul(mx.fast.rms_norm(x, weight, 1e-6), wq, scales, biases, 64, 4, glu=glu)
    assert mx.mean(got == expected).item() >= 0.99


@needs_cuda
def test_a_one_row_norm_and_product_asked_onto_the_tensor_cores_is_one_launch_there(monkeypatch):
    from engine.models import quantized_routing as routing

    x, wq, scales, biases = _product(1, 2560, 2060, 64, mx.bfloat16)
    norm = nn.RMSNorm(2560)
    norm.weight = norm.weight.astype(mx.bfloat16)
    monkeypatch.setenv(routing.MMA_ROWS_ENV, "1-16")
    fused = routing.quantized_fused(x, wq, scales, biases, group_size=64, bits=4, norm=norm, glu=True)
    assert fused is not None
    assert mx.mean(fused == mma.matmul(norm(x), wq, scales, biases, 64, 4, glu=True)).item() >= 0.99
