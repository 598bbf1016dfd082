"""Drafting with a checkpoint's own multi-token-prediction layer (Qwen3.5, Qwen3-Next,
DeepSeek V3, GLM-5).

The MTP layer reads the target's final hidden states, so it follows every forward pass
of the target (``Model.hidden_listener``): for a pass over positions o..o+T-1 it computes
its own entries for positions o-1..o+T-2 (hidden h_i with the next token x_{i+1}), first
dropping whatever it held from o-1 on (drafts of the last round, rejected tokens). Its
entries therefore always agree with the target's settled tokens up to the last pass. A
drafter made for a request whose prompt was partly cached starts its entries where the
request starts (it has not seen the earlier hidden states): its drafts then look back over
this request only.

``propose`` starts from the hidden state of the token before the pending one and the
pending token, and chains k steps on its own output. Verification keeps the output exactly
the target's (greedy: token for token), however good or bad the drafts are.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.decode.loop import HISTORY_WINDOW
from engine.errors import EngineError
from engine.models.kv_cache import KVCache

# Prefill passes longer than this evaluate the MTP layer's cache right away, so the graph
# of a long prompt is not kept alive until the first draft.
_EVAL_AFTER = 16
# Passes whose hidden states are kept (a verification, a step queued ahead, the one before).
_PASSES_KEPT = 3


class MTPDrafter:
    def __init__(self, model: Any, max_draft: int = 4):
        head = getattr(model, "mtp", None)
        if head is None:
            raise EngineError(
                "this model has no built-in multi-token-prediction (MTP) layers: they come with the original "
                "Hugging Face checkpoints of Qwen3.5 / Qwen3-Next / DeepSeek V3 / GLM-5 (mlx-lm drops them when "
                "converting); "
                "use --draft-model or --ngram instead"
            )
        self.model = model
        self.head = head
        self.max_draft = max_draft
        # The layer's own cache (DeepSeek's latent attention caches latents), and its head:
        # DeepSeek's normalises with its own shared_head.norm before the model's output head.
        self.cache = head.make_cache() if hasattr(head, "make_cache") else [KVCache() for _ in head.layers]
        self.logits = getattr(head, "logits", model.logits)
        self.base = 0  # the position of the first entry the MTP layer's cache holds
        # (first position, hidden [1, T, H]) of the last few passes, newest last: a plain step
        # queued ahead (speculative_step's lookahead) must not hide the row a draft starts from.
        self._passes: list[tuple[int, mx.array]] = []
        model.hidden_listener = self._observe

    def close(self) -> None:
        if getattr(self.model, "hidden_listener", None) == self._observe:
            self.model.hidden_listener = None

    # -- following the target -------------------------------------------------------
    # Entries are held for positions base .. base + cache offset - 1. RoPE is relative, so
    # the layer's cache may number them from base: attention is the same as from 0.

    def _held(self) -> int:
        return self.base + self.cache[0].offset

    def _start_at(self, position: int) -> None:
        for c in self.cache:
            c.trim(c.offset)
        self.base = max(0, position)

    def _back_to(self, position: int) -> None:
        """Hold entries for positions before ``position`` only (none before base: afresh)."""
        if position < self.base:
            self._start_at(position)
        elif self._held() > position:
            for c in self.cache:
                c.trim(self._held() - position)
        elif self._held() < position:  # a gap (passes not seen): continue from here
            self._start_at(position)

    def _hidden_at(self, position: int) -> mx.array | None:
        """The target's hidden state at ``position`` from the newest pass that covered it (rows
        up to a settled position agree between passes: they see the same tokens)."""
        for start, hidden in reversed(self._passes):
            row = position - start
            if 0 <= row < hidden.shape[1]:
                return hidden[:, row : row + 1]
        return None

    def _observe(self, ids: mx.array | None, hidden: mx.array, start: int) -> None:
        """The target ran positions start..start+T-1 (ids [1, T]) to final hidden states."""
        if ids is None:  # media embeddings: no ids to embed; drafting resumes after them
            self._passes = []
            return
        before = self._hidden_at(start - 1) if start > 0 else None
        if before is None:  # the entry for start - 1 cannot be made: begin at start
            self._back_to(start)
            rows, tokens = hidden[:, :-1], ids[:, 1:]
        else:
            self._back_to(start - 1)
            rows, tokens = mx.concatenate([before, hidden[:, :-1]], axis=1), ids
        if tokens.shape[1]:
            self.head(rows, self.model.embed(tokens), self.cache)
            if tokens.shape[1] > _EVAL_AFTER:
                mx.eval([c.state for c in self.cache])
        self._passes = [*self._passes[-(_PASSES_KEPT - 1) :], (start, hidden)]

    # -- drafting -----------------------------------------------------------------------

    def propose(self, history: list[int], k: int, pick) -> tuple[mx.array | list[int], mx.array | None]:
        n = len(history)
        hidden = self._hidden_at(n - 2)  # the target's, for the token before the pending one
        if k <= 0 or hidden is None:
            return [], None
        self._back_to(n - 2)
        recent = mx.array(history[-HISTORY_WINDOW:], dtype=mx.uint32)
        token = mx.array(history[-1:], dtype=mx.uint32)
        tokens, probs = [], []
        for i in range(k):
            hidden = self.head(hidden, self.model.embed(token[None]), self.cache)
            token, q = pick(self.logits(hidden)[0, -1], recent)
            mx.async_eval(token)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                recent = mx.concatenate([recent, token])[-HISTORY_WINDOW:]
        return mx.concatenate(tokens), (mx.stack(probs) if probs else None)

    def rewind(self, valid: int) -> None:
        pass  # the next pass of the target drops what the drafts added (see _observe)
