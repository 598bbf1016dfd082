"""Drafting with a checkpoint's own multi-token-prediction layer (Qwen3.5, Qwen3-Next,
DeepSeek V3, GLM-5).

The MTP layer reads the target's final hidden states, so it follows every forward pass
of the target (``Model.hidden_listener``): its entry for position i is made from the hidden
state h_i and the next token x_{i+1}. A pass over positions o..o+T-1 supersedes whatever
was seen from o on (drafts of the last round, rejected tokens), and the entries from o-1 on
are made again from it. Its entries therefore always agree with the target's settled
tokens up to the last pass. A drafter made for a request whose prompt was partly cached
starts its entries where the request starts (it has not seen the earlier hidden states):
its drafts then look back over this request only.

Entries are made when a draft needs them (``propose``), in one pass over every position
seen since the last draft: while the speculative loop decodes plain tokens (drafting does
not pay), the MTP layer costs nothing per token, and catching up later is one batched pass
(or one per ``_CATCH_UP_AFTER`` positions, so what is kept stays small).

``propose`` starts from the hidden state of the token before the pending one and the
pending token, and chains k steps on its own output. Verification keeps the output exactly
the target's (greedy: token for token), however good or bad the drafts are.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.decode.drafters import weight_bytes
from engine.decode.loop import HISTORY_WINDOW
from engine.errors import EngineError
from engine.models.kv_cache import KVCache

# Catch-up passes longer than this evaluate the MTP layer's cache right away, so the graph
# of a long prompt is not kept alive until the first draft.
_EVAL_AFTER = 16
# Positions seen but not yet made into entries beyond this are made into entries at once.
_CATCH_UP_AFTER = 256
# Entries to make before a draft up to this many are made in the drafting graph itself.
_LAZY_ENTRIES = 8


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
        # What the target's passes showed, not all made into entries yet: (first position,
        # hidden [1, T, H], ids [1, T]) runs, contiguous and in order, newest last. A pass
        # cuts off what it supersedes; entries are made up to the newest position but one.
        self._passes: list[tuple[int, mx.array, mx.array]] = []
        self._made = 0  # entries before this position agree with the passes seen
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

    def _seen(self) -> tuple[int, int]:
        """The positions the kept passes cover: [first, end)."""
        if not self._passes:
            return 0, 0
        return self._passes[0][0], self._passes[-1][0] + self._passes[-1][1].shape[1]

    def _hidden_at(self, position: int) -> mx.array | None:
        """The target's hidden state at ``position`` [1, 1, H], if a kept pass covered it."""
        for start, hidden, _ in reversed(self._passes):
            row = position - start
            if 0 <= row < hidden.shape[1]:
                return hidden[:, row : row + 1]
        return None

    def _observe(self, ids: mx.array | None, hidden: mx.array, start: int) -> None:
        """The target ran positions start..start+T-1 (ids [1, T]) to final hidden states."""
        if ids is None:  # media embeddings: no ids to embed; drafting resumes after them
            self._passes, self._made = [], start + hidden.shape[1]
            return
        if self._seen()[1] < start:  # a gap: what came before cannot lead into this pass
            self._passes = []
        self._cut(start)  # this pass supersedes what was seen from start on
        self._passes.append((start, hidden, ids))
        if self._seen()[1] - self._made > _CATCH_UP_AFTER:
            self._catch_up()

    def _cut(self, position: int) -> None:
        """Forget what the passes showed from ``position`` on, and the entries that used it."""
        while self._passes and self._passes[-1][0] >= position:  # newest last: cut from the end
            self._passes.pop()
        if self._passes:
            first, h, x = self._passes[-1]
            if first + h.shape[1] > position:
                self._passes[-1] = (first, h[:, : position - first], x[:, : position - first])
        self._made = min(self._made, max(position - 1, 0))

    def _catch_up(self) -> None:
        """Make the entries for every position the passes show up to the newest but one (its
        next token is not known), in one pass of the MTP layer; keep only the newest row."""
        first, end = self._seen()
        begin = max(self._made, first)
        if end - 1 > begin:
            hidden = mx.concatenate([h for _, h, _ in self._passes], axis=1)
            ids = mx.concatenate([x for _, _, x in self._passes], axis=1)
            self._back_to(begin)
            rows, tokens = hidden[:, begin - first : end - 1 - first], ids[:, begin + 1 - first : end - first]
            self.head(rows, self.model.embed(tokens), self.cache)
            if tokens.shape[1] > _EVAL_AFTER:
                mx.eval([c.state for c in self.cache])
            self._made = end - 1
            # Keep the last two positions: a draft starts from the row before the pending token.
            keep_from = max(first, end - 2)
            self._passes = [
                (max(s0, keep_from), h[:, max(0, keep_from - s0) :], x[:, max(0, keep_from - s0) :])
                for s0, h, x in self._passes
                if s0 + h.shape[1] > keep_from
            ]

    # -- catching up, apart from a round -----------------------------------------------

    def behind(self, history: list[int]) -> int:
        """Positions the target's passes showed that have no entry yet (made before a draft)."""
        return max(0, self._seen()[1] - 1 - self._made)

    def catch_up(self, history: list[int]) -> bool:
        """Make the entries ``propose`` would make first, when there are more than a round's
        usual one or two: after the prompt (the MTP layer's own prefill of it) or a run of
        plain tokens. Done apart, the speculative loop times it apart from the round, as the
        cost of having stopped drafting. Returns whether anything was made."""
        if self.behind(history) <= _LAZY_ENTRIES:
            return False
        self._cut(len(history) - 1)  # as propose does: nothing past the settled ids
        self._catch_up()
        mx.eval([c.state for c in self.cache])
        return True

    def relative_cost(self, target: Any) -> float:
        """What an entry costs the MTP layer, as a share of what a position costs ``target``."""
        return weight_bytes(self.head) / max(1, weight_bytes(target))

    # -- drafting -----------------------------------------------------------------------

    def propose(self, history: list[int], k: int, pick) -> tuple[mx.array | list[int], mx.array | None]:
        n = len(history)
        if k <= 0 or self._hidden_at(n - 2) is None:
            return [], None
        self._cut(n - 1)  # rows from n - 1 on saw drafts that were rejected (or none of the pending id)
        self._catch_up()
        hidden = self._hidden_at(n - 2)  # the target's, for the token before the pending one
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
