"""A decoder layer's tail in one CUDA launch (models.layer_tail_cuda): the output product and
its residual, the MLP's norm, gate/up with the activation, down with its residual.

Where MLX runs on a CUDA GPU it holds the grid of, the launch must give what the three
separate kernel launches give, to float rounding (one warp sums each column's K where the
separate launches split it), for 4 and 8 bits, groups of 32/64/128, the three dtypes, 1-6
rows and qwen3-4b's and llama3-8b's widths; its barrier must be left ready launch after
launch; and a model's compiled verify step must keep its logits. Everywhere, what it takes
and that it stays off unless asked.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import layer_tail_cuda as tail
from engine.models import quantized_matmul_cuda as qmv

needs_gpu = pytest.mark.skipif(
    not qmv.available() or tail._capability() < tail.MIN_COMPUTE_CAPABILITY,
    reason="needs MLX's CUDA backend on a GPU of compute capability 9 or more",
)


def _linear(inputs: int, outputs: int, bits=4, group=64, dtype=mx.bfloat16, seed=0, bias=False) -> nn.Module:
    layer = nn.Linear(inputs, outputs, bias=bias)
    layer.weight = (mx.random.normal((outputs, inputs), key=mx.random.key(seed)) * inputs**-0.5).astype(dtype)
    if bias:
        layer.bias = mx.zeros((outputs,), dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)


def _tail(rows=1, heads_width=512, hidden=384, intermediate=640, bits=4, group=64, dtype=mx.bfloat16, seed=0):
    """(attn rows, x, o_proj, norm, stacked gate/up (weight, scales, biases), down)."""
    keys = mx.random.split(mx.random.key(seed), 3)
    o_proj = _linear(heads_width, hidden, bits, group, dtype, seed + 1)
    gate_up = _linear(hidden, 2 * intermediate, bits, group, dtype, seed + 2)
    down = _linear(intermediate, hidden, bits, group, dtype, seed + 3)
    norm = nn.RMSNorm(hidden, eps=1e-6)
    norm.weight = (1 + 0.3 * mx.random.normal((hidden,), key=keys[0])).astype(dtype)
    attn = mx.random.normal((rows, 1, heads_width), key=keys[1]).astype(dtype)
    x = (3 * mx.random.normal((rows, 1, hidden), key=keys[2])).astype(dtype)
    stacked = (gate_up["weight"], gate_up["scales"], gate_up["biases"])
    return attn, x, o_proj, norm, stacked, down


def test_it_is_off_unless_asked_and_off_cpus(monkeypatch):
    monkeypatch.delenv(tail.ENV, raising=False)
    assert not tail.enabled()
    monkeypatch.setenv(tail.ENV, "1")
    assert tail.enabled() == (
        qmv.enabled() and tail._capability() >= tail.MIN_COMPUTE_CAPABILITY and tail.multiprocessors() > 0
    )


def test_the_barrier_counter_is_made_once_outside_mlxs_pool_of_small_buffers():
    """Buffers of 8 bytes or less come from MLX's CUDA pool of read-mostly managed memory, where
    the barrier's atomics and polling fault pages across the bus (1.4 ms a launch)."""
    holder = _Holder()
    barrier = tail.barrier_of(holder)
    assert barrier is not None and barrier.counter.nbytes > 8
    assert np.array(barrier.counter).tolist() == [0] * tail.COUNTER_WORDS
    assert tail.barrier_of(holder) is barrier


def test_a_barrier_first_met_inside_a_trace_is_a_constant_of_it():
    holder = _Holder()

    def step(x):
        return x + tail.barrier_of(holder).counter[:2].astype(mx.float32)

    compiled = mx.compile(step)
    assert compiled(mx.ones((2,))).tolist() == [1.0, 1.0]
    made = holder._layer_tail_barrier
    assert compiled(mx.full((2,), 2.0)).tolist() == [2.0, 2.0]  # a replay: the same buffer
    assert holder._layer_tail_barrier is made


def test_the_probe_counts_the_multiprocessors_the_same_each_time_and_none_off_cuda():
    counted = tail.multiprocessors()
    if not qmv.available():
        assert counted == 0
        return
    assert 1 <= counted <= 1024
    tail.multiprocessors.cache_clear()
    assert tail.multiprocessors() == counted
    assert tail.blocks() == tail.BLOCKS_PER_MULTIPROCESSOR * counted


def test_it_takes_a_few_rows_of_quantized_layers_of_one_quantization_and_an_rms_norm():
    attn, x, o_proj, norm, gate_up, down = _tail()
    assert tail.takes(attn, x, o_proj, norm, gate_up, down)
    assert tail.takes(*_tail(rows=4, bits=8, group=32, dtype=mx.float16))
    assert not tail.takes(*_tail(rows=7))  # past MAX_ROWS
    assert not tail.takes(attn, x, o_proj, nn.LayerNorm(384), gate_up, down)
    assert not tail.takes(attn, x, o_proj, norm, gate_up, _linear(640, 384, bits=8))  # other bits
    assert not tail.takes(attn, x, o_proj, norm, gate_up, _linear(640, 384, group=32))  # other groups
    assert not tail.takes(attn, x, _linear(512, 384, bias=True), norm, gate_up, down)
    assert not tail.takes(attn.astype(mx.float16), x, o_proj, norm, gate_up, down)
    wide = _tail(hidden=9216, heads_width=512, intermediate=256, dtype=mx.float32)
    assert not tail.takes(*wide)  # its norm does not fit the block's shared memory


def _apart(attn, x, o_proj, norm, gate_up, down):
    """The three launches the tail joins."""
    group, bits = o_proj.group_size, o_proj.bits
    h = qmv.matmul(attn, o_proj["weight"], o_proj["scales"], o_proj["biases"], group, bits, residual=x)
    a = qmv.matmul(h, *gate_up, group, bits, glu=True, norm=(norm.weight, norm.eps))
    return qmv.matmul(a, down["weight"], down["scales"], down["biases"], group, bits, residual=h)


class _Holder:
    pass


@needs_gpu
@pytest.mark.parametrize(
    "rows, heads_width, hidden, intermediate, bits, group, dtype",
    [
        (1, 4096, 2560, 9728, 4, 64, mx.bfloat16),  # qwen3-4b
        (1, 4096, 4096, 14336, 4, 64, mx.bfloat16),  # llama3-8b
        (3, 4096, 2560, 9728, 8, 64, mx.bfloat16),
        (6, 4096, 2560, 9728, 4, 64, mx.bfloat16),  # a verify pass of 5 drafts
        (2, 2048, 1024, 3072, 4, 32, mx.float16),
        (4, 896, 896, 4864, 4, 128, mx.float32),
        (1, 640, 384, 768, 8, 128, mx.float16),
    ],
    ids=str,
)
def test_one_launch_gives_what_the_three_launches_give(rows, heads_width, hidden, intermediate, bits, group, dtype):
    parts = _tail(rows, heads_width, hidden, intermediate, bits, group, dtype, seed=rows + bits)
    assert tail.takes(*parts)
    together = tail.layer_tail(*parts, _Holder()).astype(mx.float32)
    apart = _apart(*parts).astype(mx.float32)
    assert together.shape == (rows, 1, hidden)
    scale = mx.abs(apart).max().item()
    tolerance = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    assert mx.abs(together - apart).max().item() <= tolerance * scale


@needs_gpu
def test_its_barrier_is_left_ready_launch_after_launch():
    parts = _tail(rows=1, heads_width=4096, hidden=2560, intermediate=9728)
    holder = _Holder()
    x = parts[1]
    for _ in range(20):  # a chain: each launch's residual is the one before's output
        x = tail.layer_tail(parts[0], x, *parts[2:], holder)
    mx.eval(x)
    assert np.array(holder._layer_tail_barrier.counter).tolist() == [0] * tail.COUNTER_WORDS  # 40 flips, counts undone
    assert bool(mx.all(mx.isfinite(x)).item())


@needs_gpu
def test_a_models_compiled_verify_step_keeps_its_logits(monkeypatch):
    """A 4-bit Qwen3-shaped model's compiled verify step (2 rows) with each layer's tail in one
    launch: every layer takes it and the logits stay those of the separate launches to
    bfloat16 rounding."""
    from tests.engine.models.test_qmv_cuda import _compiled_verify_logits, _two_layer_qwen25

    model = _two_layer_qwen25(seed=7, shape="qwen3-4b", hidden_size=1024, intermediate_size=1536, vocab_size=10000)
    calls = []
    launch = tail.layer_tail
    monkeypatch.setattr(tail, "layer_tail", lambda *a, **k: calls.append(1) or launch(*a, **k))
    logits = {n: _compiled_verify_logits(monkeypatch, model, tail.ENV, n, calls) for n in ("0", "1")}
    assert len(calls) == 2  # traced once for "1": each layer's tail
    logits = {n: a.astype(mx.float32) for n, a in logits.items()}
    assert mx.abs(logits["1"] - logits["0"]).max().item() <= 2e-2 * mx.abs(logits["0"]).max().item()
