"""Compiled decode steps for hybrid stacks: gated DeltaNet layers mixed with gated full
attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

A decode step is bound by per-op overhead (engine/decode/compiled_step.py says why), and a
hybrid layer builds more small ops than an attention layer: the convolution, the q/k
normalisation, the gates, the delta rule and its gated norm, then a mixture of experts.
Here a recurrent layer is one ``mx.compile``d function from (hidden states, conv inputs,
recurrent state) to (hidden states, new conv inputs, new states): the state goes in and
out, so nothing about the cache is traced. An attention layer is two: everything up to
the rotated queries/keys, then everything after the attention itself, which runs outside
on the cache's exact prefix (its key count grows every token).

The traced functions call the layers' own pure pieces (``GatedDeltaNet.mix``,
``GatedAttention.gated_qkv`` / ``gated_out``, the feed-forward), so they compute the plain
forward pass's ops on the same values; only elementwise ops fuse. A pass of a few tokens
(a speculative verification) also returns the state after each token, which the cache
keeps for rolling rejected drafts back, as the plain pass does.

Weights are captured when the functions are traced; ``prepare`` retraces when they were
replaced (adapters, a reload), as the attention-only decoder does.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.decode.compiled_step import CompiledDecoder, _links, _links_hold
from engine.decode.compiled_step import compiled_decoder as attention_decoder
from engine.models.base import RoPE
from engine.models.kv_cache import KVCache
from engine.models.lora import active_signature
from engine.models.paged_kv import PagedKVCache
from engine.models.recurrent_cache import RecurrentCache
from engine.models.stacked import stack_projections


def _layer_ok(layer: Any) -> bool:
    if getattr(layer, "is_linear", None) is True:
        return hasattr(getattr(layer, "linear_attn", None), "mix")
    attn = getattr(layer, "self_attn", None)
    return (
        getattr(layer, "is_linear", None) is False
        and hasattr(attn, "gated_qkv")
        and hasattr(attn, "gated_out")
        # RoPE variants that pick settings from the position need it as a Python int.
        and type(getattr(attn, "rope", None)) is RoPE
    )


class HybridDecoder:
    """``decoder(tokens, cache)`` -> logits [n, vocab] for n new tokens, or None when the
    plain forward pass must run (the caller then runs it). Same interface as
    ``CompiledDecoder``; each number of tokens is traced once, on first use. Like the model's
    own pass, it shows an MTP drafter (``hidden_listener``) the final hidden states."""

    feeds_listener = True

    def __init__(self, model: Any):
        self._model = weakref.ref(model)  # the decoder lives on the model: no cycle
        stack = getattr(model, "model", None)
        layers = getattr(model, "layers", None) or []
        self.supported = (
            hasattr(model, "logits")
            and hasattr(stack, "embed")
            and hasattr(stack, "norm")
            and len(layers) > 0
            and any(layer.is_linear for layer in layers if _layer_ok(layer))
            and all(_layer_ok(layer) for layer in layers)
        )
        self._links: list[tuple[Any, Any, Any]] = []
        self._signature = ""
        self._fns: dict[int, list[Any]] = {}  # tokens per pass -> one function per piece
        self.traces = 0  # sizes of pass traced so far (each slow on first use)

    def prepare(self) -> bool:
        if not self.supported:
            return False
        model = self._model()
        signature = active_signature(model)
        if signature != self._signature or not _links_hold(model, self._links):
            # Drop the old traces first: they hold the arrays that stacking replaces.
            self._fns = {}
            stack_projections(model)  # the projections of one input as one matmul
            self._links, self._signature = _links(model), signature
        return True

    def _build(self, n: int) -> list[Any]:
        """For ``n`` tokens: per layer, one function (recurrent) or two (attention: before
        and after the attention itself), then the head."""
        ref = self._model
        layers = ref().layers
        fns: list[Any] = []

        def recurrent(i: int):
            def fn(h, before, state):
                layer = ref().layers[i]
                mixed, padded, states = layer.linear_attn.mix(layer.input_layernorm(h), before, state, n > 1)
                h = h + mixed
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                kernel = layer.linear_attn.conv_kernel
                convs = [padded[:, t : t + kernel - 1] for t in range(1, n + 1)]
                return h, convs, states

            return mx.compile(fn)

        def attention_in(i: int):
            def fn(h, pos):
                layer = ref().layers[i]
                return layer.self_attn.gated_qkv(layer.input_layernorm(h), pos)

            return mx.compile(fn)

        def attention_out(i: int):
            def fn(h, attn, gate):
                layer = ref().layers[i]
                h = h + layer.self_attn.gated_out(attn, gate)
                return h + layer.mlp(layer.post_attention_layernorm(h))

            return mx.compile(fn)

        def head(h):
            model = ref()
            hidden = model.model.norm(h)
            return model.logits(hidden)[0], hidden

        for i, layer in enumerate(layers):
            fns.append(recurrent(i) if layer.is_linear else (attention_in(i), attention_out(i)))
        fns.append(mx.compile(head))
        return fns

    def __call__(self, tokens: mx.array, cache: Sequence[Any], shift: int = 0) -> mx.array | None:
        """Logits [n, vocab] after feeding ``tokens`` (shape [n]) through ``cache``."""
        model = self._model()
        n = int(tokens.shape[0])
        if shift or model is None:
            return None  # multimodal positions: the plain pass
        masks = self._masks(model.layers, cache, n)
        if masks is None:
            return None
        fns = self._fns.get(n)
        if fns is None:
            fns = self._fns[n] = self._build(n)
            self.traces += 1
        start = cache[0].offset
        pos = mx.array(start, dtype=mx.int32)
        h = model.model.embed(tokens[None])
        for layer, c, fn, mask in zip(model.layers, cache, fns, masks):
            if layer.is_linear:
                c.begin(n)
                h, convs, states = fn(h, c[0], c[1])
                for t in range(1, n):  # the state after each token, for rolling drafts back
                    c.record(t, [convs[t - 1], states[t - 1]])
                c[0], c[1] = convs[-1], states[-1]
                c.advance(n)
            else:
                before, after = fn
                q, gate, k, v = before(h, pos)
                k, v = c.update_and_fetch(k, v)
                h = after(h, layer.self_attn.attend(q, k, v, mask), gate)
        logits, hidden = fns[-1](h)
        listener = getattr(model, "hidden_listener", None)
        if listener is not None:  # an MTP drafter follows the final hidden states, as in Model.__call__
            listener(tokens[None], hidden, start)
        return logits

    def _masks(self, layers: Sequence[Any], cache: Sequence[Any], n: int) -> list[Any] | None:
        """Each layer's attention mask (None for recurrent layers), or None when this cache
        cannot take a compiled step: not the plain kinds, an empty state, a long pass."""
        if len(cache) != len(layers) or not cache:
            return None
        offset = cache[0].offset
        masks = []
        for layer, c in zip(layers, cache):
            if getattr(c, "offset", None) != offset:
                return None
            if layer.is_linear:
                if type(c) is not RecurrentCache or c[0] is None or c[1] is None or n > c.step_window:
                    return None
                masks.append(None)
                continue
            if type(c) not in (KVCache, PagedKVCache) or c.empty():  # the write and attention run outside
                return None
            mask = c.make_mask(n, None)
            if mask is not None and not isinstance(mask, str):
                return None
            masks.append(mask)
        return masks

    def rows(self, tokens: mx.array, cache: Sequence[Any]) -> None:
        """Batched decoding keeps the plain pass for hybrid stacks."""
        return None


def compiled_decoder(model: Any) -> CompiledDecoder | HybridDecoder | None:
    """The model's compiled decoder: the attention-only one where it applies, else the
    hybrid one (made once per model and kept on it); None when neither applies."""
    decoder = attention_decoder(model)
    if decoder is not None:
        return decoder
    hybrid = getattr(model, "_hybrid_decoder", None)
    if hybrid is None:
        hybrid = HybridDecoder(model)
        try:
            object.__setattr__(model, "_hybrid_decoder", hybrid)
        except AttributeError:
            pass
    return hybrid if hybrid.supported else None
