"""Decode steps (one new token, or the few a speculative round verifies) with most of
their work in compiled functions.

Decoding is bound by per-step overhead, not by the device: building ~20 small ops per
layer in Python and launching each as its own kernel. Here each layer boundary (the
previous layer's output projection, residuals and feed-forward, then this layer's norm,
q/k/v projections and RoPE) is one ``mx.compile``d function: Python makes one call where
it made ~20, and elementwise ops fuse.

Only the cache write and the attention run outside, on the cache's exact prefix: its key count
grows every token, and the fast attention kernel takes no length argument (a padded
buffer would need an array mask, which sends the GPU to a slower path). With the split
attention kernel turned on (``MLX_DESK_DECODE_ATTENTION=1``, CUDA), which takes the key count
as an input, the attention moves inside: each layer's function starts with the previous
layer's attention over its whole cache buffer, traced once a buffer capacity, and only the
cache write stays outside. The buffer then grows by ``INSIDE_STEP`` tokens, not the cache's
256: each capacity costs a trace of every layer, and the kernel's cost follows the key
count, not the capacity.

Results equal the plain forward pass: the same ops run in the same order on the same
values; only elementwise ops are fused (same dtypes, no reassociation).

A ``CompiledDecoder`` is tied to one model. Weights are captured when the functions
are traced; ``prepare`` notices replaced weights (adapters fused, weights reloaded)
and retraces. Traced shapes do not change from token to token: each layer is traced
once per number of new tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.models import decode_attention_cuda, l2_ahead_cuda
from engine.models.base import AttentionSteps, RoPE, cached_attention_kv
from engine.models.kv_cache import KVCache, RotatingKVCache
from engine.models.lora import active_signature
from engine.models.paged_kv import PagedKVCache
from engine.models.quantized_kv_cache import QuantizedKVCache
from engine.models.stacked import MAX_STACKED_ROWS, stack_projections

# The cache write happens outside the traces (update_and_fetch, make_mask), so any of these
# serves, a paged layer's (blocks written, its contiguous view read) too.
_CACHE_KINDS = (KVCache, RotatingKVCache, QuantizedKVCache, PagedKVCache)

# The growth step of a cache buffer while the attention runs inside the traces. A capacity
# is a trace of every layer (1.2-1.7 ms a qwen3-4b layer on a two-core CPU: about 50 ms for
# 36 layers), once every 256 tokens at the cache's own step; a longer step costs memory only
# (qwen3-4b: 147 KB a token), since the kernel divides the key count, not the capacity,
# between its slices. A cache a prompt filled grows to one step at its first inside write,
# so a short decode is traced once.
INSIDE_STEP = 1024


def _layer_ok(layer: Any) -> bool:
    attn = getattr(layer, "self_attn", None)
    return (
        attn is not None
        and all(hasattr(attn, name) for name in ("qkv", "attend", "out"))
        and hasattr(layer, "finish")
        and hasattr(layer, "input_layernorm")
        # RoPE variants that pick settings from the position need it as a Python int.
        and type(getattr(attn, "rope", None)) is RoPE
        # Attention that measured slower compiled than plain says so (latent attention).
        and getattr(attn, "compiled_decode", True)
    )


def _declines(layer: Any) -> bool:
    """Whether the layer's attention opts out of the compiled step (``compiled_decode``)."""
    return not getattr(getattr(layer, "self_attn", None), "compiled_decode", True)


class CompiledDecoder:
    """``decoder(tokens, cache)`` -> logits [n, vocab] for n new tokens (one per decode
    step, a few to verify drafts), or None when this model/cache combination needs the
    plain forward pass (the caller then uses it). Each n is traced once, on first use."""

    def __init__(self, model: Any):
        # Weak: the model keeps its decoder, and the decoder must not keep the model
        # (nor its weights, through traced closures) alive once the model is dropped.
        self._model = weakref.ref(model)
        self.supported = (
            all(hasattr(model, name) for name in ("embed", "head", "layers"))
            and len(model.layers) > 0
            and all(_layer_ok(layer) for layer in model.layers)
        )
        # Models whose layers opt out still get their projections stacked by ``prepare``
        # (which then returns False): their plain pass uses the stacks for a few rows.
        self.stack_only = not self.supported and any(_declines(layer) for layer in getattr(model, "layers", []))
        self._links: list[tuple[Any, Any, Any]] = []  # what the traces were built from
        self._signature = ""
        self._fns: list[Any] = []
        self._inside: list[Any] = []  # boundaries with the previous layer's attention inside
        # (query heads, KV heads, head dim) where every layer's attention could run inside
        # (``_inside_heads``), set when traced: a step then checks only its caches.
        self._heads: tuple[int, int, int] | None = None
        self._last_rows: Any = None
        # Sizes of passes run since the last trace (new tokens, and the cache buffers' capacity
        # where attention runs inside), and how many were ever traced: a new size is traced
        # (and, on a GPU, its kernels built) on first use, so its pass is slow.
        self._sizes: set[tuple[int, int | None]] = set()
        self.traces = 0

    # -- building -------------------------------------------------------------------

    def prepare(self) -> bool:
        """(Re)trace if the model's weights changed since the last trace; call once per
        generation, not per token. Before tracing, q/k/v and gate/up are stacked into
        one matmul each (``models.fused``). Returns whether compiled decoding is available."""
        if not self.supported:
            if self.stack_only:
                self._stack_for_plain_pass()
            return False
        model = self._model()
        # Switching adapters changes what a layer computes without replacing any array.
        signature = active_signature(model)
        if signature != self._signature or not _links_hold(model, self._links):
            # Drop the old traces first: they hold the arrays that stacking replaces.
            self._fns, self._inside, self._links, self._sizes = [], [], [], set()
            stack_projections(model)
            self._links, self._signature = _links(model), signature
            self._heads = _inside_heads(model.layers)
            self._fns = self._build()
        return True

    def _stack_for_plain_pass(self) -> None:
        model = self._model()
        signature = active_signature(model)
        if signature != self._signature or not _links_hold(model, self._links):
            stack_projections(model)
            self._links, self._signature = _links(model), signature

    def _build(self) -> list[Any]:
        ref = self._model
        n_layers = len(ref().layers)

        def layer(i: int) -> Any:
            return ref().layers[i]

        def start(i: int, h, pos):
            this = layer(i)
            attn = this.self_attn
            # The weights the products after attention read, asked into L2 while it runs:
            # by the heads kernel where one runs, else by a kernel of their own.
            ahead = (
                this.weights_after_attention(h)
                if l2_ahead_cuda.enabled() and hasattr(this, "weights_after_attention")
                else []
            )
            with l2_ahead_cuda.asking(ahead):
                if hasattr(attn, "q_kv"):  # the norm may join the q/k/v product, keys and values a stack
                    q, kv = attn.q_kv(h, pos, this.input_layernorm)
                else:
                    q, k, v = attn.qkv(this.input_layernorm(h), pos)
                    kv = (k, v)
                left = l2_ahead_cuda.left()
            if left:
                q = l2_ahead_cuda.ahead(q, left)
            return h, q, kv

        def end(i: int, h, attn):
            prev = layer(i)
            if hasattr(prev, "finish_attention"):  # the residual add may join the output product
                return prev.finish_attention(h, attn)
            return prev.finish(h, prev.self_attn.out(attn))

        def first(tokens, pos):
            return start(0, ref().embed(tokens), pos)

        def boundary(i: int):
            def fn(h, attn, pos):
                return start(i, end(i - 1, h, attn), pos)

            return fn

        def last(h, attn):
            return ref().head(end(n_layers - 1, h, attn))[0]

        def last_rows(h, attn):
            return ref().head(end(n_layers - 1, h, attn))[:, -1]

        # The same boundaries with the previous layer's attention inside: over its whole cache
        # buffer, the key count an input (``_inside_count``).
        def attend(i: int, q, buffer, n_keys):
            return decode_attention_cuda.attend_counted(q, buffer, n_keys, layer(i).self_attn.scale)

        def boundary_inside(i: int):
            def fn(h, q, buffer, n_keys, pos):
                return start(i, end(i - 1, h, attend(i - 1, q, buffer, n_keys)), pos)

            return fn

        def last_inside(h, q, buffer, n_keys):
            return last(h, attend(n_layers - 1, q, buffer, n_keys))

        # Traced functions capture no model object, only (through the trace) its arrays.
        self._last_rows = mx.compile(last_rows)
        if self._heads is not None:
            self._inside = [mx.compile(boundary_inside(i)) for i in range(1, n_layers)] + [mx.compile(last_inside)]
        return [mx.compile(first)] + [mx.compile(boundary(i)) for i in range(1, n_layers)] + [mx.compile(last)]

    # -- one step -------------------------------------------------------------------

    def masks(self, cache: Sequence[Any], n: int) -> list[Any] | None:
        """Each layer's attention mask for ``n`` new tokens, or None when this cache state
        cannot take a compiled step (checked before any change)."""
        if not self._fns or len(cache) != len(self._fns) - 1 or not 0 < n <= MAX_STACKED_ROWS:
            return None
        offset = cache[0].offset
        masks = []
        for layer, c in zip(self._model().layers, cache):
            if not isinstance(c, _CACHE_KINDS) or c.empty() or c.offset != offset:
                return None
            mask = c.make_mask(n, getattr(layer, "window", None))
            if mask is not None and not isinstance(mask, str):
                return None  # a boolean window mask: the plain pass builds it
            masks.append(mask)
        return masks

    def __call__(self, tokens: mx.array, cache: Sequence[Any], shift: int = 0) -> mx.array | None:
        """Logits [n, vocab] after feeding ``tokens`` (shape [n], a decode step or a
        speculative verification) through ``cache``.

        ``shift`` moves the positions off the cache offset: after an image, multimodal
        RoPE (Qwen2.5-VL, Qwen3-VL) continues text at offset + the prompt's delta, with
        the three position ids equal, which is plain RoPE at that position."""
        n = int(tokens.shape[0])
        masks = self.masks(cache, n)
        if masks is None:
            return None
        layers = self._model().layers
        # A DFlash drafter's tap (models.base.DecoderStack.layer_tap) reads layer outputs,
        # which the traces hand back between layers; the last layer's (normed) stays inside
        # the head's trace, so a tap naming it takes the plain pass.
        tap = getattr(getattr(self._model(), "model", None), "layer_tap", None)
        if tap is not None and len(layers) - 1 in tap.layer_ids:
            return None
        n_keys = self._inside_count(cache, masks[0], n)
        size = (n, None if n_keys is None else cache[0].capacity_after(n, INSIDE_STEP))
        if size not in self._sizes:
            self._sizes.add(size)
            self.traces += 1
        start = cache[0].offset
        pos = mx.array(start + shift, dtype=mx.int32)
        h: mx.array = tokens[None]
        attn: Any = None  # the previous layer's attention, or (queries, cache buffer) for it
        taken = []
        for i, (layer, c, mask) in enumerate(zip(layers, cache, masks)):
            if i == 0:
                h, q, kv = self._fns[0](h, pos)
            else:
                # h: layer i - 1's output
                h, q, kv = self._fns[i](h, attn, pos) if n_keys is None else self._inside[i - 1](h, *attn, n_keys, pos)
                if tap is not None and i - 1 in tap.layer_ids:
                    taken.append(h)
            # The cache write stays outside: a write at a traced position is a dynamic
            # update, which cannot always reuse the buffer in place.
            if n_keys is None:
                attn = cached_attention_kv(layer.self_attn, q, kv, c, mask)
            else:
                attn = (q, c.write(kv, INSIDE_STEP))
        if tap is not None:
            tap(taken, start)
        return self._fns[-1](h, attn) if n_keys is None else self._inside[-1](h, *attn, n_keys)

    def _inside_count(self, cache: Sequence[Any], mask: Any, n: int) -> mx.array | None:
        """The key count after this step (int32 [1]) where every layer's attention can run
        inside the traces: the split kernel over each layer's whole cache buffer
        (``decode_attention_cuda.attend_counted``, on with ``MLX_DESK_DECODE_ATTENTION=1``),
        so that a step builds no attention op in Python, where outside the traces its two
        kernel calls a layer cost more host time than MLX's one. Else None, checked before
        any write: the layers once, when traced (``_inside_heads``); here, every step, that
        each cache holds one buffer of the same shape and dtype (0.6 us a layer on a small
        CPU, where checking the layers too took 4.3). ``mask``: the layers' mask, one for all
        (no layer has a window)."""
        if self._heads is None or not decode_attention_cuda.enabled():
            return None
        n_heads, n_kv, d = self._heads
        c0 = cache[0]
        buffer = getattr(c0, "buffer", None)
        if buffer is None:
            return None
        shape, dtype = buffer.shape, buffer.dtype
        if (shape[2], shape[4]) != (n_kv, d) or not decode_attention_cuda.fits(
            n_heads, n_kv, n, c0.offset + n, d, dtype, mask
        ):
            return None
        for c in cache:
            if type(c) is not KVCache or c.buffer is None or c.buffer.shape != shape or c.buffer.dtype != dtype:
                return None
        return mx.array([c0.offset + n], dtype=mx.int32)

    def rows(self, tokens: mx.array, cache: Sequence[Any]) -> mx.array | None:
        """Logits [rows, vocab] for one new token per row (``tokens`` [rows, 1]) through a
        batch cache (engine.decode.batch.BatchKVCache: one RoPE offset per row, a mask for
        the rows' left padding); None when the plain pass must run. Each number of rows is
        traced once. The matmuls run on the real rows only: padding 2-7 rows to 8 (for
        CUDA's tiled quantized matmul) made 2 and 4 streams slower on an H200."""
        b = tokens.shape[0]
        if not self._fns or len(cache) != len(self._fns) - 1 or b > MAX_STACKED_ROWS:
            return None
        layers = self._model().layers
        if any(getattr(layer, "window", None) is not None for layer in layers):
            return None
        mask = cache[0].make_mask(1)
        pos = cache[0].offset
        h: mx.array = tokens
        attn = None
        for i, (layer, c) in enumerate(zip(layers, cache)):
            if i == 0:
                h, q, kv = self._fns[0](h, pos)
            else:
                h, q, kv = self._fns[i](h, attn, pos)
            attn = cached_attention_kv(layer.self_attn, q, kv, c, mask)
        return self._last_rows(h, attn)


def _inside_heads(layers: Sequence[Any]) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head dim) where every layer is plain attention (no sinks,
    soft caps or window, so one mask serves all) of those sizes, which a compiled step can
    run inside its traces (``CompiledDecoder._inside_count``); else None."""
    heads = None
    for layer in layers:
        attn = layer.self_attn
        if type(attn).attend is not AttentionSteps.attend or getattr(layer, "window", None) is not None:
            return None
        these = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None), getattr(attn, "head_dim", None)
        if None in these or heads not in (None, these):
            return None
        heads = these
    return heads


def _links(model: Any) -> list[tuple[Any, Any, Any]]:
    """Every (container, key, value) link from ``model`` down to its arrays, and each
    container's length (key None), walking its modules, lists and dicts. The model itself
    is written as None: the decoder lives on the model and must not hold it."""
    links: list[tuple[Any, Any, Any]] = []
    todo = [model]
    while todo:
        node = todo.pop()
        held = None if node is model else node
        links.append((held, None, len(node)))
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(value, (mx.array, dict, list)):
                links.append((held, key, value))
                if not isinstance(value, mx.array):
                    todo.append(value)
    return links


def _links_hold(model: Any, links: list[tuple[Any, Any, Any]]) -> bool:
    """Whether nothing in ``model`` was replaced, added or removed since ``_links``: one
    lookup per link, where flattening the parameters cost about 3 ms on an 8B model,
    paid before every first token."""
    if not links:
        return False
    for node, key, value in links:
        node = model if node is None else node
        if key is None:
            if len(node) != value:
                return False
        elif node[key] is not value:
            return False
    return True


def compiled_decoder(model: Any) -> CompiledDecoder | None:
    """The model's decoder (made once per model object and kept on it); None when the
    model's layers do not offer the pieces a compiled step needs."""
    decoder = getattr(model, "_compiled_decoder", None)
    if decoder is None:
        decoder = CompiledDecoder(model)
        try:
            object.__setattr__(model, "_compiled_decoder", decoder)
        except AttributeError:
            pass
    return decoder if decoder.supported or decoder.stack_only else None
