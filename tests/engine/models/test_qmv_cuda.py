"""The small-row quantized matmul kernel for CUDA (models.quantized_matmul_cuda).

Where MLX runs on CUDA, the kernel must equal ``mx.quantized_matmul`` (transpose=True) to
float rounding for 4 and 8 bits, groups of 32/64/128, float32/float16/bfloat16 and 1-16
rows, over shapes whose input size is not a multiple of a warp's stride and whose output
count is not a multiple of a block's columns; a row's output must not depend on the rows
beside it. Elsewhere only the routing is checked: which products go to the kernel, and that
nothing routes while it is off or off CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.models import quantized_matmul_cuda as qmv
from engine.models import quantized_mma_cuda as tensor_cores
from engine.models import quantized_routing as routing

needs_cuda = pytest.mark.skipif(not qmv.available(), reason="needs MLX's CUDA backend")


def _fits(rows=1, inputs=2560, outputs=4096, bits=4, group_size=64, mode="affine", dtype=mx.bfloat16, **kw):
    return qmv.fits(
        rows,
        inputs,
        outputs,
        bits=bits,
        group_size=group_size,
        mode=mode,
        dtype=dtype,
        scales_dtype=kw.get("scales_dtype", dtype),
        has_biases=kw.get("has_biases", True),
    )


def test_decode_verify_and_batch_shapes_of_affine_4_and_8_bits_go_to_the_kernel():
    for rows in (1, 2, 5, 8, 16):
        for bits in (4, 8):
            for group in (32, 64, 128):
                for dtype in (mx.bfloat16, mx.float16, mx.float32):
                    assert _fits(rows=rows, bits=bits, group_size=group, dtype=dtype)
    assert _fits(inputs=9728, outputs=2560)
    assert _fits(inputs=64, outputs=3, group_size=64)  # one group, fewer columns than a warp owns


def test_the_kernel_is_routed_only_where_it_was_measured_faster():
    """2-12 rows always (verify passes, batches of up to 12 streams); one row on large
    matrices only; from 13 rows MLX's tiled kernel, although the kernel could take up to 16."""
    assert routing.pays(2, 896, 896) and routing.pays(5, 2560, 4096) and routing.pays(6, 14336, 4096)
    assert routing.pays(1, 4096, 28672) and routing.pays(1, 14336, 4096)  # llama3-8b gate+up, down
    assert not routing.pays(1, 2560, 4096) and not routing.pays(1, 896, 1152)  # qwen3-4b q, qwen2.5-0.5b q/k/v
    assert routing.pays(1, 4096, 2560, fused=True) and routing.pays(1, 2560, 6144, fused=True)  # qwen3-4b o, q/k/v
    assert not routing.pays(1, 896, 896, fused=True)
    assert routing.pays(7, 4096, 28672) and routing.pays(7, 896, 896)
    assert routing.pays(8, 2560, 19456) and routing.pays(12, 9728, 2560)  # qwen3-4b's batch steps
    assert not routing.pays(13, 4096, 28672) and not routing.pays(16, 14336, 4096)
    assert _fits(rows=8) and _fits(rows=16)


def test_2_3_5_and_6_bit_codes_go_to_the_kernel_only_when_asked(monkeypatch):
    monkeypatch.setenv(qmv.OTHER_BITS_ENV, "1")
    assert _fits(bits=2, group_size=64) and _fits(bits=2, group_size=128) and _fits(bits=4, group_size=32)
    assert not _fits(bits=2, group_size=32)  # a lane's 16 bytes would span two groups
    for bits, rows in qmv.ROW_LIMITS.items():
        assert _fits(bits=bits, group_size=64, rows=rows) and not _fits(bits=bits, group_size=64, rows=rows + 1)
    assert all(_fits(bits=b, group_size=g, rows=16) for b in (3, 6) for g in (32, 64, 128))
    assert all(_fits(bits=5, group_size=g) for g in (32, 64, 128))
    assert not _fits(bits=7) and not _fits(bits=1)
    monkeypatch.setenv(qmv.OTHER_BITS_ENV, "0")
    assert not any(_fits(bits=b, group_size=64) for b in (2, 3, 5, 6)) and _fits(bits=4)


def test_the_float_modes_go_to_the_kernel_only_when_asked(monkeypatch):
    floats = {"scales_dtype": mx.uint8, "has_biases": False, "group_size": 32}
    nvfp4 = {**floats, "group_size": 16, "bits": 4, "mode": "nvfp4"}
    monkeypatch.setenv(qmv.FLOAT_MODES_ENV, "1")
    assert _fits(bits=4, mode="mxfp4", **floats) and _fits(bits=8, mode="mxfp8", rows=16, **floats)
    assert _fits(**nvfp4) and not _fits(inputs=2560 + 16, **nvfp4)  # two groups a lane's chunk
    assert not _fits(bits=8, mode="mxfp4", **floats) and not _fits(bits=4, mode="mxfp4", scales_dtype=mx.bfloat16)
    assert not tensor_cores.fits(8, 2560, 4096, bits=4, mode="mxfp4", dtype=mx.bfloat16, **floats)
    monkeypatch.setenv(qmv.FLOAT_MODES_ENV, "0")
    assert not _fits(bits=4, mode="mxfp4", **floats) and not _fits(bits=8, mode="mxfp8", **floats)
    assert not _fits(**nvfp4)


def test_other_modes_widths_row_counts_and_mixed_dtypes_keep_mlxs_kernel():
    assert not _fits(rows=17)  # a prefill chunk: MLX's tiled kernel
    assert not _fits(rows=0)
    assert not _fits(bits=3) and not _fits(bits=2) and not _fits(bits=6)
    assert not _fits(bits=2, group_size=64) and not _fits(bits=2, group_size=128)
    assert not _fits(group_size=16)
    assert not _fits(mode="mxfp4", group_size=32) and not _fits(mode="nvfp4", group_size=16)
    assert not _fits(has_biases=False)
    assert not _fits(dtype=mx.float32, scales_dtype=mx.bfloat16)  # MLX promotes; ours would not
    assert not _fits(inputs=2560 + 32, group_size=64)  # not whole groups
    assert not _fits(dtype=mx.int32)


@pytest.mark.parametrize(
    "inputs, outputs, bits, splits",
    [
        (2560, 19456, 4, 1),  # qwen3-4b gate+up: columns enough to fill the grid
        (4096, 28672, 4, 1),  # llama3-8b gate+up
        (2560, 4096, 4, 2),  # qwen3-4b q: 80 chunks of 16 bytes a row, two warps of lanes
        (2560, 4096, 8, 4),
        (9728, 2560, 4, 4),  # qwen3-4b down: few columns for a long row
        (14336, 4096, 4, 4),  # llama3-8b down
        (896, 1152, 4, 1),  # qwen2.5-0.5b q/k/v: under one chunk a lane
    ],
)
def test_warps_split_long_rows_of_matrices_with_few_columns(inputs, outputs, bits, splits):
    assert qmv.k_splits(inputs, outputs, bits) == splits
    assert qmv.WARPS % splits == 0


def test_the_kernel_is_on_by_default_where_it_can_run_and_off_when_asked(monkeypatch):
    monkeypatch.delenv(qmv.ENV, raising=False)
    assert qmv.enabled() == qmv.available()
    monkeypatch.setenv(qmv.ENV, "1")
    assert qmv.enabled() == qmv.available()
    monkeypatch.setenv(qmv.ENV, "0")
    assert not qmv.enabled()


@pytest.mark.parametrize("kind", ["residual", "glu", "norm"])
def test_each_small_op_joins_the_products_wherever_the_kernel_is_and_not_when_asked(monkeypatch, kind):
    monkeypatch.delenv(qmv.ENV, raising=False)
    monkeypatch.delenv(routing.FUSIONS[kind], raising=False)
    assert routing.fusion_enabled(kind) == qmv.available()
    monkeypatch.setenv(routing.FUSIONS[kind], "0")
    assert not routing.fusion_enabled(kind)
    monkeypatch.setenv(routing.FUSIONS[kind], "1")
    monkeypatch.setenv(qmv.ENV, "0")
    assert not routing.fusion_enabled(kind)


def test_only_plain_rms_norms_of_rows_that_fit_the_blocks_memory_join_a_product(monkeypatch):
    monkeypatch.setattr(qmv, "available", lambda: True)  # the routing only
    monkeypatch.setenv(routing.NORM_ENV, "1")
    norm = nn.RMSNorm(2560, eps=1e-5)
    norm.set_dtype(mx.bfloat16)
    x = mx.zeros((1, 1, 2560), mx.bfloat16)
    weight, eps = routing.prologue_norm(norm, x)
    assert weight is norm.weight and eps == 1e-5
    assert routing.prologue_norm(norm, mx.zeros((1, 6, 2560), mx.bfloat16)) is not None
    assert routing.prologue_norm(norm, mx.zeros((1, 7, 2560), mx.bfloat16)) is None  # 35 KB of rows
    assert routing.prologue_norm(norm, x.astype(mx.float16)) is None  # the weight's dtype differs
    assert routing.prologue_norm(nn.LayerNorm(2560), x) is None
    wide = nn.RMSNorm(4096)  # llama3-8b's rows: the norm runs on its own there (measured faster)
    wide.set_dtype(mx.bfloat16)
    assert routing.prologue_norm(wide, mx.zeros((1, 1, 4096), mx.bfloat16)) is None


def test_the_gated_mlp_is_silu_of_gate_times_up_wherever_the_epilogue_does_not_run(monkeypatch):
    """``GatedMLP.gated`` is ``silu(gate(x)) * up(x)`` of the stacked product bit for bit off
    CUDA or turned off, and the kernel's activation epilogue is not asked for."""
    from engine.models.base import GATE_UP, GatedMLP
    from engine.models.stacked import project, stack_projections

    monkeypatch.setenv(routing.GLU_ENV, "0")
    mlp = GatedMLP(128, 320)
    nn.quantize(mlp, group_size=64, bits=4)
    mlp.set_dtype(mx.bfloat16)
    assert stack_projections(mlp) == 1
    x = mx.random.normal((1, 3, 128), key=mx.random.key(9)).astype(mx.bfloat16)
    kernel = qmv.matmul
    monkeypatch.setattr(qmv, "matmul", lambda *a, **k: pytest.fail("fused") if k.get("glu") else kernel(*a, **k))
    gate, up = project(mlp, GATE_UP, x)
    assert mx.array_equal(mlp.gated(x), nn.silu(gate) * up)


def test_the_routed_entry_points_equal_mlxs_where_the_kernel_does_not_run(monkeypatch):
    """On the CPU build (or with the kernel off) the hooks the shared layers call must give
    exactly what the layers themselves give."""
    monkeypatch.setenv(qmv.ENV, "1")
    if qmv.available():
        monkeypatch.setenv(qmv.ENV, "0")
    layer = nn.QuantizedLinear(128, 48, bias=True, group_size=64, bits=4)
    embed = nn.QuantizedEmbedding(40, 128, group_size=64, bits=8)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(1))
    assert mx.array_equal(routing.linear(layer, x), layer(x))
    assert mx.array_equal(routing.embedding_logits(embed, x), embed.as_linear(x))
    plain = nn.Linear(128, 8)
    assert mx.array_equal(routing.linear(plain, x), plain(x))


@pytest.mark.parametrize("kernel", ["on", "off"])
@pytest.mark.parametrize("lead", [(13, 1), (3, 5), (16, 1)])
def test_a_batchs_rows_reach_mlxs_kernel_as_one_matrix(monkeypatch, lead, kernel):
    """Where MLX's kernel keeps a product on CUDA, a batch step's [B, L, K] rows go to it as
    one [B * L, K] matrix (MLX runs B separate products, each reading the weight), and the
    result is MLX's product of those rows in the batch's shape; with our kernel off too."""
    monkeypatch.setattr(qmv, "available", lambda: True)  # routing only: these row counts stay MLX's
    if kernel == "off":
        monkeypatch.setenv(qmv.ENV, "0")
    else:
        monkeypatch.delenv(qmv.ENV, raising=False)
    w = mx.random.normal((48, 128), key=mx.random.key(2))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((*lead, 128), key=mx.random.key(3))
    seen = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda a, *r, **kw: seen.append(a.shape) or real(a, *r, **kw))
    y = routing.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)
    assert seen == [(lead[0] * lead[1], 128)]
    assert y.shape == (*lead, 48)
    flat = real(x.reshape(-1, 128), wq, scales, biases, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(y, flat.reshape(*lead, 48))
    assert mx.allclose(y, real(x, wq, scales, biases, transpose=True, group_size=64, bits=4), atol=1e-4)


# rows, inputs, outputs: the decode/verify/batch row counts over inputs below, at and past
# a warp's stride (1,024 4-bit or 512 8-bit values) and outputs not a multiple of a
# block's 16 columns; the real projections of qwen3-4b and llama3-8b.
SHAPES = [
    (1, 2560, 4096),
    (2, 4096, 4096 + 8),
    (3, 640, 37),
    (4, 9728, 2560),
    (5, 2176, 1000),
    (6, 128, 5),
    (8, 2560, 19456),
    (11, 1280, 333),
    (16, 14336, 4096),
]
MODES = [(bits, group) for bits in (4, 8) for group in (32, 64, 128)]
DTYPES = [mx.bfloat16, mx.float16, mx.float32]
# Every mode in every dtype, each on one of the shapes in turn (every shape gets several
# modes and dtypes), and the big projections at the decode and batch row counts: one
# kernel build per row count, dtype and mode, so not the whole cross product.
CASES = [
    (*SHAPES[(i * len(DTYPES) + j) % len(SHAPES)], bits, group, dtype)
    for i, (bits, group) in enumerate(MODES)
    for j, dtype in enumerate(DTYPES)
] + [(rows, 2560, 19456, 4, 64, mx.bfloat16) for rows in (1, 8, 16)]
# Output tolerance against the float32 referee, relative to the output's largest magnitude:
# a few roundings of the output's own dtype (half an ulp is 2^-9 of a bfloat16 and 2^-11 of
# a float16; the kernel sums in float32 and rounds once).
TOLERANCE = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}
# From MLX's own on the GPU: both rounded to the dtype; in float32 MLX may take TF32 tensor
# cores for several rows (~1e-3).
APART = {mx.float32: 2e-3, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _case(rows, inputs, outputs, bits, group, dtype):
    k1, k2 = mx.random.split(mx.random.key(rows * 7919 + inputs + outputs + bits * 131 + group), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    return x, wq, scales, biases


def _referee(x, wq, scales, biases, group, bits):
    # On the CPU in float32: the inputs converted exactly, no tensor-core rounding.
    with mx.stream(mx.cpu):
        return mx.quantized_matmul(
            x.astype(mx.float32),
            wq,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            transpose=True,
            group_size=group,
            bits=bits,
        )


@needs_cuda
@pytest.mark.parametrize("rows, inputs, outputs, bits, group, dtype", CASES, ids=str)
def test_the_kernel_equals_mlxs_quantized_matmul(rows, inputs, outputs, bits, group, dtype):
    x, wq, scales, biases = _case(rows, inputs, outputs, bits, group, dtype)
    assert _fits(rows, inputs, outputs, bits=bits, group_size=group, dtype=dtype)
    got = qmv.matmul(x, wq, scales, biases, group, bits)
    mlx_own = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
    expected = _referee(x, wq, scales, biases, group, bits)
    assert got.dtype == mlx_own.dtype == dtype and got.shape == mlx_own.shape == (rows, outputs)
    size = mx.abs(expected).max().item()
    ours = mx.abs(got.astype(mx.float32) - expected).max().item()
    theirs = mx.abs(mlx_own.astype(mx.float32) - expected).max().item()
    # Within rounding of the referee, and of MLX's own (which rounds to the dtype as well).
    assert ours <= TOLERANCE[dtype] * size, (ours, theirs, size)
    apart = mx.abs(got.astype(mx.float32) - mlx_own.astype(mx.float32)).max().item()
    assert apart <= APART[dtype] * size, (apart, ours, theirs, size)


@needs_cuda
@pytest.mark.parametrize(
    "rows, inputs, outputs, bits, group, dtype",
    [
        (1, 2560, 4096, 2, 64, mx.bfloat16),
        (5, 9728, 2560, 2, 128, mx.float16),
        (8, 640, 37, 2, 64, mx.float32),
        (1, 2560, 4096, 3, 64, mx.bfloat16),
        (16, 1280, 333, 3, 32, mx.float16),
        (3, 9728, 2560, 5, 64, mx.bfloat16),
        (1, 2560, 19456, 6, 64, mx.bfloat16),
        (11, 2176, 1000, 6, 128, mx.float32),
    ],
    ids=str,
)
def test_other_widths_equal_mlxs_quantized_matmul(monkeypatch, rows, inputs, outputs, bits, group, dtype):
    monkeypatch.setenv(qmv.OTHER_BITS_ENV, "1")
    x, wq, scales, biases = _case(rows, inputs, outputs, bits, group, dtype)
    assert _fits(rows, inputs, outputs, bits=bits, group_size=group, dtype=dtype)
    got = qmv.matmul(x, wq, scales, biases, group, bits)
    expected = _referee(x, wq, scales, biases, group, bits)
    size = mx.abs(expected).max().item()
    assert mx.abs(got.astype(mx.float32) - expected).max().item() <= TOLERANCE[dtype] * size


@needs_cuda
@pytest.mark.parametrize(
    "rows, inputs, outputs, mode, dtype",
    [
        (1, 2560, 4096, "mxfp4", mx.bfloat16),
        (5, 9728, 2560, "mxfp4", mx.float16),
        (16, 640, 37, "mxfp4", mx.float32),
        (1, 2560, 19456, "mxfp8", mx.bfloat16),
        (8, 2176, 1000, "mxfp8", mx.float16),
        (1, 2560, 4096, "nvfp4", mx.bfloat16),
        (6, 9728, 2560, "nvfp4", mx.float16),
        (16, 640, 37, "nvfp4", mx.float32),
    ],
    ids=str,
)
def test_float_modes_equal_mlxs_quantized_matmul(monkeypatch, rows, inputs, outputs, mode, dtype):
    monkeypatch.setenv(qmv.FLOAT_MODES_ENV, "1")
    bits, group = qmv.FLOAT_MODES[mode]
    k1, k2 = mx.random.split(mx.random.key(rows + inputs + outputs), 2)
    w = (mx.random.normal((outputs, inputs), key=k1) * inputs**-0.5).astype(dtype)
    wq, scales = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    x = mx.random.normal((rows, inputs), key=k2).astype(dtype)
    assert qmv.takes(rows, x, wq, scales, None, group, bits, mode)
    got = qmv.matmul(x, wq, scales, None, group, bits, mode=mode)
    with mx.stream(mx.cpu):
        expected = mx.quantized_matmul(
            x.astype(mx.float32), wq, scales, None, transpose=True, group_size=group, bits=bits, mode=mode
        )
    size = mx.abs(expected).max().item()
    assert mx.abs(got.astype(mx.float32) - expected).max().item() <= TOLERANCE[dtype] * size


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(bits):
    x, wq, scales, biases = _case(16, 2560, 1030, bits, 64, mx.bfloat16)
    many = qmv.matmul(x, wq, scales, biases, 64, bits)
    for r in (0, 5, 15):
        one = qmv.matmul(x[r : r + 1], wq, scales, biases, 64, bits)
        assert mx.array_equal(one[0], many[r])


@needs_cuda
def test_leading_axes_strided_inputs_and_row_views_of_a_weight(monkeypatch):
    """A [B, L, K] activation, a non-contiguous one, and a weight that is a row slice of a
    larger one (the stacked projections' views) route and give MLX's result."""
    monkeypatch.setenv(qmv.ENV, "1")
    x, wq, scales, biases = _case(6, 1024, 96, 4, 64, mx.bfloat16)
    view = (wq[32:80], scales[32:80], biases[32:80])
    x3 = x.reshape(2, 3, 1024)
    strided = mx.random.normal((1024, 4), key=mx.random.key(3)).astype(mx.bfloat16).T
    for inputs in (x3, strided):
        got = routing.quantized_matmul(inputs, *view, group_size=64, bits=4)
        expected = _referee(inputs.reshape(-1, 1024), *view, 64, 4).reshape(*inputs.shape[:-1], 48)
        assert got.shape == expected.shape and got.dtype == mx.bfloat16
        assert mx.abs(got.astype(mx.float32) - expected).max().item() <= 8e-3 * mx.abs(expected).max().item()


def _two_layer_qwen25(seed: int, shape: str = "qwen2.5-0.5b", **sizes):
    """qwen2.5-0.5b's shape (or ``shape``'s, with ``sizes`` changed) cut to two layers, random
    bfloat16 weights at 4 bits, with its projections stacked as a decode step takes them."""
    from engine.cli.bench import SHAPES as BENCH_SHAPES
    from engine.models import get_family
    from engine.models.stacked import stack_projections

    config = dict(BENCH_SHAPES[shape], num_hidden_layers=2, **sizes)
    family = get_family(config["model_type"])
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    stack_projections(model)
    mx.eval(model.parameters())
    return model


def _compiled_verify_logits(monkeypatch, model, env: str, value: str, calls: list) -> mx.array:
    """The logits of a compiled two-token verify step after a three-token prompt, traced with
    ``env`` set to ``value`` (the setting is read while tracing); ``calls`` emptied first."""
    from engine.decode.compiled_step import compiled_decoder
    from engine.models.kv_cache import KVCache

    monkeypatch.setenv(env, value)
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([[11, 523, 9001]]), cache=cache))
    decoder = compiled_decoder(model)
    decoder.prepare()
    decoder._fns = decoder._build()
    calls.clear()
    return decoder(mx.array([4242, 77]), cache)


@needs_cuda
def test_a_models_shared_layers_route_through_the_kernel_and_keep_its_logits(monkeypatch):
    """A 4-bit qwen2.5-0.5b-shaped model (stacked q/k/v and gate/up, o/down, the tied head):
    with the kernel on, every projection of a 5-token pass runs it and the logits stay those
    of MLX's kernel to bfloat16 rounding."""
    model = _two_layer_qwen25(seed=3)
    tokens = mx.array([[11, 523, 9001, 77, 4242]])

    monkeypatch.setenv(qmv.ENV, "0")
    plain = model(tokens).astype(mx.float32)
    calls = []
    kernel = qmv.matmul
    monkeypatch.setattr(qmv, "matmul", lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))
    monkeypatch.setenv(qmv.ENV, "1")
    routed = model(tokens).astype(mx.float32)
    assert len(calls) == 2 * 4 + 1  # per layer: q/k/v, o, gate/up, down; then the head
    assert mx.abs(routed - plain).max().item() <= 5e-2 * mx.abs(plain).max().item()


def test_the_mlp_plus_its_residual_is_the_add_wherever_the_epilogue_does_not_run(monkeypatch):
    """``GatedMLP.plus`` (the last add of a Llama-style layer) is ``residual + mlp(x)`` bit for
    bit where the kernel's epilogue does not run: off CUDA, or turned off."""
    from engine.models.base import GatedMLP

    monkeypatch.setenv(routing.RESIDUAL_ENV, "0")
    mlp = GatedMLP(128, 320)
    nn.quantize(mlp, group_size=64, bits=4)
    x = mx.random.normal((1, 3, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    h = mx.random.normal((1, 3, 128), key=mx.random.key(6)).astype(mx.bfloat16)
    mlp.set_dtype(mx.bfloat16)
    assert mx.array_equal(mlp.plus(h, x), h + mlp(x))
    assert not routing.fusion_enabled("residual")


def test_a_layer_finished_from_its_attention_is_finished_as_before(monkeypatch):
    """``finish_attention`` (a compiled step's path, whose first add may join the output
    product) is ``finish(x, out(attn))`` bit for bit where the epilogue does not run."""
    from engine.cli.bench import SHAPES as BENCH_SHAPES
    from engine.models import get_family

    monkeypatch.setenv(routing.RESIDUAL_ENV, "0")
    config = dict(BENCH_SHAPES["qwen3-4b"], num_hidden_layers=1, hidden_size=128, intermediate_size=256)
    config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300)
    family = get_family(config["model_type"])
    layer = family.Model(family.ModelArgs.from_dict(config)).layers[0]
    nn.quantize(layer, group_size=64, bits=4)
    x = mx.random.normal((1, 2, 128), key=mx.random.key(7))
    attn = mx.random.normal((1, 4, 2, 32), key=mx.random.key(8))
    assert mx.array_equal(layer.finish_attention(x, attn), layer.finish(x, layer.self_attn.out(attn)))


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_kernels_residual_epilogue_is_the_product_then_the_add(dtype, rows):
    x, wq, scales, biases = _case(rows, 9728, 2560, 4, 64, dtype)
    residual = (4 * mx.random.normal((rows, 2560), key=mx.random.key(rows))).astype(dtype)
    fused = qmv.matmul(x, wq, scales, biases, 64, 4, residual=residual)
    assert mx.array_equal(fused, residual + qmv.matmul(x, wq, scales, biases, 64, 4))


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 4, 12])
def test_the_kernels_glu_epilogue_is_silu_of_the_gate_times_the_up_product(dtype, rows):
    """Bit for bit what MLX's ops compute from the product (silu rounds as MLX's own
    elementwise kernels do), for a K-split matrix (down-like, 2 x 1,280 outputs of 9,728) and a
    wide one."""
    for inputs, outputs in ((9728, 1280), (2560, 4864)):
        x, wq, scales, biases = _case(rows, inputs, 2 * outputs, 4, 64, dtype)
        fused = qmv.matmul(x, wq, scales, biases, 64, 4, glu=True)
        gate, up = mx.split(qmv.matmul(x, wq, scales, biases, 64, 4), 2, axis=-1)
        assert fused.shape == (rows, outputs)
        assert mx.array_equal(fused, nn.silu(gate) * up)


@needs_cuda
def test_a_models_logits_are_the_same_with_the_glu_epilogue_on(monkeypatch):
    """A 4-bit qwen2.5-0.5b-shaped model's two-token pass and a compiled verify step with each
    layer's activation in its gate/up product's epilogue give the logits of the separate ops,
    bit for bit."""

    model = _two_layer_qwen25(seed=5)
    tokens = mx.array([[4242, 77]])
    monkeypatch.setenv(routing.GLU_ENV, "0")
    apart = model(tokens)
    calls = []
    kernel = qmv.matmul
    monkeypatch.setattr(qmv, "matmul", lambda *a, **k: calls.append(k.get("glu", False)) or kernel(*a, **k))
    monkeypatch.setenv(routing.GLU_ENV, "1")
    assert mx.array_equal(model(tokens), apart)
    assert calls.count(True) == 2  # each layer's gate/up product took its activation

    logits = {glu: _compiled_verify_logits(monkeypatch, model, routing.GLU_ENV, glu, calls) for glu in ("0", "1")}
    assert calls.count(True) == 2
    assert mx.array_equal(logits["1"], logits["0"])


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("rows, glu", [(1, False), (4, False), (1, True), (6, True)])
def test_the_kernels_norm_prologue_is_mlxs_rms_norm_then_the_product(dtype, rows, glu):
    """The product of ``mx.fast.rms_norm(x)``: the kernel sums the squares in another order
    than MLX's norm, so its scale may part by a float32 rounding, which in float16 and
    bfloat16 almost never reaches a normed value."""
    x, wq, scales, biases = _case(rows, 2560, 2 * 2432, 4, 64, dtype)
    x = 3 * x + 0.5
    weight = (1 + 0.3 * mx.random.normal((2560,), key=mx.random.key(rows))).astype(dtype)
    fused = qmv.matmul(x, wq, scales, biases, 64, 4, glu=glu, norm=(weight, 1e-6))
    apart = qmv.matmul(mx.fast.rms_norm(x, weight, 1e-6), wq, scales, biases, 64, 4, glu=glu)
    assert fused.shape == apart.shape == (rows, 2432 if glu else 4864)
    if dtype == mx.float32:
        assert mx.allclose(fused, apart, rtol=1e-5, atol=1e-5)
    else:
        assert mx.mean(fused == apart).item() >= 0.99


@needs_cuda
def test_a_models_logits_stay_with_the_norm_prologue_on(monkeypatch):
    """A 4-bit Qwen3-shaped model's compiled verify step with each layer's norms in its q/k/v
    and gate/up products' prologues: every norm joins its product and the logits stay those
    of the separate norms to bfloat16 rounding."""

    model = _two_layer_qwen25(seed=6, shape="qwen3-4b", hidden_size=1024, intermediate_size=1536, vocab_size=10000)
    calls = []
    kernel = qmv.matmul
    monkeypatch.setattr(qmv, "matmul", lambda *a, **k: calls.append(k.get("norm") is not None) or kernel(*a, **k))
    logits = {n: _compiled_verify_logits(monkeypatch, model, routing.NORM_ENV, n, calls) for n in ("0", "1")}
    logits = {n: a.astype(mx.float32) for n, a in logits.items()}
    assert calls.count(True) == 2 * 2  # each layer's q/k/v and gate/up
    apart = mx.abs(logits["1"] - logits["0"]).max().item()
    assert apart <= 2e-2 * mx.abs(logits["0"]).max().item()


@needs_cuda
def test_a_models_logits_are_the_same_with_the_epilogue_on(monkeypatch):
    """A 4-bit qwen2.5-0.5b-shaped model's two-token pass (a verify pass: 2 rows take the
    kernel on any matrix) with the down products' residual adds in the kernel's epilogue gives
    the logits of the separate adds, bit for bit."""
    model = _two_layer_qwen25(seed=4)
    tokens = mx.array([[4242, 77]])
    monkeypatch.setenv(routing.RESIDUAL_ENV, "0")
    apart = model(tokens)
    calls = []
    kernel = qmv.matmul
    monkeypatch.setattr(qmv, "matmul", lambda *a, **k: calls.append("residual" in k) or kernel(*a, **k))
    monkeypatch.setenv(routing.RESIDUAL_ENV, "1")
    together = model(tokens)
    assert calls.count(True) == 2  # each layer's down product took its residual
    assert mx.array_equal(together, apart)

    # A compiled verify step: each layer's output and down products take their residuals.
    logits = {r: _compiled_verify_logits(monkeypatch, model, routing.RESIDUAL_ENV, r, calls) for r in ("0", "1")}
    assert calls.count(True) == 2 * 2
    assert mx.array_equal(logits["1"], logits["0"])


UNROLL_4 = "#define CHUNK_UNROLL\nconstexpr int CHUNK_UNROLL_COUNT = 4;\n"


@pytest.mark.parametrize(
    "unroll, prefetch, define",
    [
        ("", "", ""),
        ("1", "0", ""),
        ("x", "", ""),
        ("9", "", ""),
        ("4", "", UNROLL_4),
        ("4", "1", "#define CHUNK_PREFETCH\n"),
        ("", "1", "#define CHUNK_PREFETCH\n"),
        ("", "yes", ""),
    ],
)
def test_the_k_loop_is_unrolled_or_prefetched_only_when_asked(monkeypatch, unroll, prefetch, define):
    monkeypatch.setenv(qmv.UNROLL_ENV, unroll)
    monkeypatch.setenv(qmv.PREFETCH_ENV, prefetch)
    assert qmv.chunk_loop() == define


ONE_OP = "#define ONE_OP_CODES\n"


@pytest.mark.parametrize(
    "value, wide, narrow",
    [("", ONE_OP, ""), ("0", "", ""), ("yes", "", ""), ("1", ONE_OP, ONE_OP)],
)
def test_codes_take_one_logic_op_where_the_warps_are_wide_unless_told(monkeypatch, value, wide, narrow):
    """By default the 1-2-row build (8 columns a warp) unpacks with one op, the pair that was
    timed; 3-16 rows keep two; the switch sets it for every build, 0 or 1."""
    monkeypatch.setenv(qmv.ONE_OP_ENV, value)
    if not value:
        monkeypatch.delenv(qmv.ONE_OP_ENV)
    assert qmv.build_switches(1).endswith(wide) and qmv.build_switches(qmv.WIDE_ROWS).endswith(wide)
    assert qmv.build_switches(qmv.WIDE_ROWS + 1).endswith(narrow)
    assert (ONE_OP in qmv.build_switches(1)) == bool(wide)
    assert (ONE_OP in qmv.build_switches(qmv.WIDE_ROWS + 1)) == bool(narrow)


def test_narrow_warps_take_two_ops_a_code(monkeypatch):
    monkeypatch.setenv(qmv.COLUMNS_ENV, "4")
    assert qmv.columns(1) == qmv.COLUMNS
    assert ONE_OP not in qmv.build_switches(1)


@pytest.mark.parametrize(
    "value, line",
    [("", ""), ("x", ""), ("-1", ""), ("33", ""), ("0", "__launch_bounds__(128)"), ("8", "__launch_bounds__(128, 8)")],
)
def test_launch_bounds_only_when_asked(monkeypatch, value, line):
    monkeypatch.setenv(qmv.BOUNDS_ENV, value)
    assert qmv.bounds().endswith(f"{line}\n" if line else "")
    assert (line in qmv.bounds()) and bool(qmv.bounds()) == bool(line)


@needs_cuda
@pytest.mark.parametrize("rows, glu", [(1, False), (1, True), (2, True), (5, False)])
@pytest.mark.parametrize(
    "env, value",
    [
        (qmv.UNROLL_ENV, "4"),
        (qmv.PREFETCH_ENV, "1"),
        (qmv.BOUNDS_ENV, "8"),
        (qmv.ONE_OP_ENV, "1"),
        (qmv.ONE_OP_ENV, "0"),
        (qmv.COLUMNS_ENV, "4"),
    ],
)
def test_each_build_switch_gives_the_same_bits(monkeypatch, rows, glu, env, value):
    """None of them changes an operation or reorders a lane's sums, so the products are bit for
    bit the same (8 columns a warp, the default for 1-2 rows: 1,030 outputs leave the last warp 6)."""
    x, wq, scales, biases = _case(rows, 2560, 1030 * (2 if glu else 1), 4, 64, mx.bfloat16)
    plain = qmv.matmul(x, wq, scales, biases, 64, 4, glu=glu)
    monkeypatch.setenv(env, value)
    walked = qmv.matmul(x, wq, scales, biases, 64, 4, glu=glu)
    assert mx.array_equal(plain, walked)


@needs_cuda
@pytest.mark.parametrize("rows, inputs, glu", [(1, 2560, True), (1, 2560, False), (2, 4096, True), (5, 2560, False)])
def test_the_first_chunk_loaded_before_the_norm_gives_the_same_bits(monkeypatch, rows, inputs, glu):
    """``MLX_DESK_QMV_EARLY_LOAD`` moves a load, not a sum: the normed products' bits do not
    change (qwen3-4b's K of 2,560 is one or two chunks a lane; llama3-8b's 4,096 more)."""
    x, wq, scales, biases = _case(rows, inputs, 1030 * (2 if glu else 1), 4, 64, mx.bfloat16)
    weight = (1 + 0.3 * mx.random.normal((inputs,), key=mx.random.key(rows))).astype(mx.bfloat16)
    plain = qmv.matmul(x, wq, scales, biases, 64, 4, glu=glu, norm=(weight, 1e-6))
    monkeypatch.setenv(qmv.EARLY_ENV, "1")
    early = qmv.matmul(x, wq, scales, biases, 64, 4, glu=glu, norm=(weight, 1e-6))
    assert mx.array_equal(plain, early)


@pytest.mark.parametrize(
    "value, rows",
    [
        ("", range(8, 17)),
        ("1-16", range(1, 17)),
        ("1-7", range(1, 8)),
        ("0-4", range(8, 17)),
        ("9-3", range(8, 17)),
        ("1-17", range(8, 17)),
        ("x", range(8, 17)),
    ],
)
def test_the_tensor_core_kernels_rows_change_only_when_asked_with_1_to_16(monkeypatch, value, rows):
    monkeypatch.setenv(routing.MMA_ROWS_ENV, value)
    assert routing.mma_rows() == rows


@needs_cuda
def test_one_row_asked_onto_the_tensor_core_kernel_goes_there(monkeypatch):

    x, wq, scales, biases = _case(1, 2560, 1030, 4, 64, mx.bfloat16)
    monkeypatch.setenv(routing.MMA_ROWS_ENV, "1-16")
    routed = routing.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)
    assert mx.array_equal(routed, tensor_cores.matmul(x, wq, scales, biases, 64, 4))
