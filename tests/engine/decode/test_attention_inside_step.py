"""A compiled decode step with each layer's attention inside the traced functions
(engine.decode.compiled_step, ``_inside_count``): the cache is written outside, the whole
buffer and the key count go into the next layer's function, and the logits must equal the
step that attends outside, across a growth of the buffer and for a verify pass.

On CUDA the attention inside is the split kernel over the buffer (its source checked against
MLX's attention in test_decode_attention_emulated.py, the kernel in
test_decode_attention_cuda.py); here, where that kernel cannot run, MLX's own attention over
the whole buffer with the same key count as a mask stands in for it, so what is checked is
the step's plumbing: which buffer, which count, which layer."""

from __future__ import annotations

import mlx.core as mx

from engine.decode import compiled_step
from engine.decode.compiled_step import CompiledDecoder
from engine.models import cache_buffers, decode_attention_cuda
from engine.models.kv_cache import KVCache
from tests.engine.models.model_goldens import load_golden

PROMPT = [5, 17, 3, 29, 11]


def _counted_attention(queries, buffer, n_keys, scale):
    """Attention of the queries over the first ``n_keys`` keys of ``buffer``, causal."""
    n_q, capacity = queries.shape[2], buffer.shape[3]
    last_seen = n_keys - n_q + mx.arange(n_q)  # the last key each query row sees
    mask = mx.arange(capacity)[None, :] <= last_seen[:, None]
    return mx.fast.scaled_dot_product_attention(queries, buffer[0, :], buffer[1, :], scale=scale, mask=mask)


def _steps(model, inside: bool, monkeypatch) -> tuple[list[mx.array], CompiledDecoder, list[int]]:
    """Logits of four one-token steps and a three-token verify pass after ``PROMPT``, through
    caches that grow every 4 tokens outside and every 10 inside (no spare tokens past them);
    the buffers' capacities seen."""
    monkeypatch.setattr(cache_buffers, "DECODE_KERNEL_PAD", 0)
    monkeypatch.setattr(compiled_step, "INSIDE_STEP", 10)
    if inside:
        monkeypatch.setattr(decode_attention_cuda, "enabled", lambda: True)
        monkeypatch.setattr(decode_attention_cuda, "takes", lambda *a: False)  # the pass outside: MLX's
        monkeypatch.setattr(decode_attention_cuda, "attend_counted", _counted_attention)
    cache = [KVCache(step=4) for _ in model.layers]
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    decoder = CompiledDecoder(model)
    assert decoder.prepare()
    logits, capacities = [], []
    for tokens in ([7], [8], [9], [10], [12, 13, 14]):
        out = decoder(mx.array(tokens), cache)
        assert out is not None
        mx.eval(out)
        logits.append(out)
        capacities.append(cache[0].buffer.shape[3])
    monkeypatch.undo()
    return logits, decoder, capacities


def test_attention_inside_the_traces_keeps_the_logits_of_attention_outside(monkeypatch):
    model, _ = load_golden("qwen3")
    outside, _, _ = _steps(model, False, monkeypatch)
    inside, decoder, capacities = _steps(model, True, monkeypatch)
    # The prompt's buffer (8 tokens) grew to one inside step at the first inside write, then
    # by that step for the verify pass: two traces where the cache's own step made three.
    assert capacities == [10, 10, 10, 10, 20]
    # Each (tokens, capacity) is traced once: the inside path ran, one trace per size.
    assert decoder.traces == len({(1, c) for c in capacities[:4]} | {(3, capacities[4])})
    for ours, ref in zip(inside, outside, strict=True):
        assert mx.allclose(ours, ref, atol=1e-4, rtol=1e-4).item(), mx.abs(ours - ref).max().item()


def test_a_step_attends_outside_where_a_layer_cannot_take_it_inside(monkeypatch):
    """The check runs before any write: a cache of another kind, or more keys than the
    kernel takes, leaves the whole step outside."""
    model, _ = load_golden("qwen3")
    decoder = CompiledDecoder(model)
    assert decoder.prepare()
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    monkeypatch.setattr(decode_attention_cuda, "enabled", lambda: True)
    layers = model.layers
    count = decoder._inside_count(cache, None, 1)
    assert count is not None and count.item() == len(PROMPT) + 1
    # The layers are checked once, when traced: a window on one of them (its own mask) or
    # heads of another size leave every step outside.
    assert compiled_step._inside_heads(layers) == (
        layers[0].self_attn.n_heads,
        layers[0].self_attn.n_kv_heads,
        layers[0].self_attn.head_dim,
    )
    monkeypatch.setattr(layers[1], "window", 4, raising=False)
    assert compiled_step._inside_heads(layers) is None
    monkeypatch.undo()
    monkeypatch.setattr(layers[1].self_attn, "n_kv_heads", layers[1].self_attn.n_kv_heads * 2)
    assert compiled_step._inside_heads(layers) is None
    monkeypatch.undo()
    monkeypatch.setattr(decode_attention_cuda, "enabled", lambda: True)
    monkeypatch.setattr(decode_attention_cuda, "MAX_KEYS", len(PROMPT))  # the count is the limit
    assert decoder._inside_count(cache, None, 1) is None
    monkeypatch.undo()
    monkeypatch.setattr(decode_attention_cuda, "enabled", lambda: True)
    assert decoder._inside_count([cache[0], object(), *cache[2:]], None, 1) is None
    monkeypatch.undo()
    assert decoder._inside_count(cache, None, 1) is None  # off unless turned on
