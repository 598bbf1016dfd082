"""Drafting with a DFlash block drafter (``engine.models.dflash``).

The drafter reads hidden states of a few target layers. It follows every cached forward
pass of the target through the stack's ``layer_tap`` (prefill chunks, verify passes, plain
steps): no extra target pass is ever run. A pass over positions s..s+T-1 supersedes what was
seen from s on (the drafts of a round, rejected or not), so what the drafter keeps always
agrees with the settled tokens up to the last pass.

The drafter's context is its own KV cache of context rows: for each settled position p, the
keys and values each drafter layer makes from the target's features at p. They depend on
those features alone (every drafter layer reads the same projected features), so rows are
added once, as positions settle, and never recomputed. A round:

1. add the rows of the positions settled since the last round (up to the token before the
   pending one, the last the target has run);
2. one drafter pass over the block [pending token, mask, ..., mask] (``block_size`` long,
   positions right after the context) gives B - 1 draft distributions; ``denoising_steps`` > 1
   runs the pass again with the masks replaced by the previous pass's greedy guesses;
3. the block's own keys/values leave the cache; the first k drafts go to verification
   (``engine.decode.speculative``: longest greedy match, or rejection sampling with the
   distributions each draft was drawn from, so the target's distribution is kept).

A drafter made for a request whose prompt was partly cached (prefix reuse) starts its
context where this request's passes start: its drafts then look back over this request
only; the output is the target's either way. Adaptive depth (``DraftDepth``) picks k up to
B - 1 from measured acceptance and costs, as for the other drafters.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.decode.drafters import weight_bytes
from engine.decode.prefill import HISTORY_WINDOW
from engine.errors import EngineError
from engine.models.base import DecoderStack

# Positions seen but not yet made into context rows beyond this many are made at once.
_CATCH_UP_AFTER = 256
# Rows to add before a draft up to this many join the drafting graph itself.
_LAZY_ROWS = 8


def check_target(target: Any) -> None:
    """Refuse, in one line, a target whose layer loop cannot show its hidden states."""
    stack = getattr(target, "model", None)
    if (
        not isinstance(stack, DecoderStack)
        or type(stack).run is not DecoderStack.run
        or type(stack).__call__ is not DecoderStack.__call__  # a pass that may not go through run
    ):
        raise EngineError(
            f"DFlash drafting needs a target of a family whose layers it can read "
            f"(Llama, Qwen2, Qwen3, Mistral); {getattr(target, 'model_type', type(target).__name__)} is not one: "
            "use --draft-model with an ordinary draft model, or --ngram"
        )


class DFlashDrafter:
    may_miss = False

    def __init__(self, target: Any, draft: Any, max_draft: int | None = None):
        check_target(target)
        block = int(draft.block_size)
        if block < 2:
            raise EngineError(f"the DFlash drafter's block_size is {block}: it must be at least 2 to draft")
        self.target, self.draft = target, draft
        self.max_draft = min(max_draft or block - 1, block - 1)
        ids = list(draft.args.target_layer_ids)
        self.layer_ids = frozenset(ids)
        ascending = sorted(self.layer_ids)
        self._order = [ascending.index(i) for i in ids]  # the tap hands layers in ascending order
        self.cache = draft.make_cache()
        self.base = 0  # the position of the first context row the cache holds
        # What the target's passes showed, not all made into rows yet: (first position,
        # features [1, T, n_ids * H]) runs, contiguous and in order, newest last.
        self._passes: list[tuple[int, mx.array]] = []
        target.model.layer_tap = self

    def close(self) -> None:
        if getattr(self.target.model, "layer_tap", None) is self:
            self.target.model.layer_tap = None

    # -- following the target -------------------------------------------------------

    def __call__(self, taken: list[mx.array], start: int) -> None:
        """The target ran positions start..start+T-1; ``taken`` are the named layers' outputs."""
        features = mx.concatenate([taken[j] for j in self._order], axis=-1)
        if self._seen()[1] < start or start < self._held():  # a gap, or the settled rows were redone
            self._passes = []
            if start < self._held():
                self._back_to(start)
        self._cut(start)
        self._passes.append((start, features))
        if self._seen()[1] - self._held() > _CATCH_UP_AFTER:
            self._add_rows(start)  # everything before this pass has settled

    def _held(self) -> int:
        return self.base + self.cache[0].offset

    def _seen(self) -> tuple[int, int]:
        if not self._passes:
            return 0, 0
        return self._passes[0][0], self._passes[-1][0] + self._passes[-1][1].shape[1]

    def _cut(self, position: int) -> None:
        """Forget what the passes showed from ``position`` on."""
        while self._passes and self._passes[-1][0] >= position:
            self._passes.pop()
        if self._passes:
            first, f = self._passes[-1]
            if first + f.shape[1] > position:
                self._passes[-1] = (first, f[:, : position - first])

    def _back_to(self, position: int) -> None:
        """Hold rows for positions before ``position`` only."""
        if position <= self.base:
            for c in self.cache:
                c.trim(c.offset)
            self.base = max(0, position)
        elif self._held() > position:
            for c in self.cache:
                c.trim(self._held() - position)

    def _add_rows(self, end: int) -> None:
        """Make the context rows of the seen positions from the rows held up to ``end``."""
        first, seen_end = self._seen()
        end = min(end, seen_end)
        if first > self._held():  # a gap (a cached prompt prefix): the context starts afresh here
            for c in self.cache:
                c.trim(c.offset)
            self.base = first
        held = self._held()
        if end <= held:
            return
        features = mx.concatenate([f for _, f in self._passes], axis=1)[:, held - first : end - first]
        self.draft.absorb(features, self.cache)
        if features.shape[1] > _LAZY_ROWS:
            mx.eval([c.state for c in self.cache])
        self._passes = [(max(s, end), f[:, max(0, end - s) :]) for s, f in self._passes if s + f.shape[1] > end]

    # -- catching up, apart from a round -----------------------------------------------

    def behind(self, history: list[int]) -> int:
        return max(0, min(self._seen()[1], len(history) - 1) - self._held())

    def catch_up(self, history: list[int]) -> bool:
        if self.behind(history) <= _LAZY_ROWS:
            return False
        self._cut(len(history) - 1)
        self._add_rows(len(history) - 1)
        mx.eval([c.state for c in self.cache])
        return True

    def relative_cost(self, target: Any) -> float:
        return weight_bytes(self.draft) / max(1, weight_bytes(target))

    # -- drafting -----------------------------------------------------------------------

    def block_logits(self, pending: int) -> mx.array:
        """Lazy logits [B - 1, V] of the block after the held context, which starts with
        ``pending``; the cache is left holding the context rows only."""
        draft, target = self.draft, self.target
        block = [pending] + [draft.mask_token_id] * (draft.block_size - 1)
        ids = mx.array(block, dtype=mx.uint32)[None]
        for step in range(draft.args.denoising_steps):
            hidden = draft(draft.embed(target, ids), self.cache)
            for c in self.cache:
                c.trim(draft.block_size)
            logits = draft.logits(target, hidden[0, 1:])
            if step + 1 < draft.args.denoising_steps:  # the next pass reads this one's guesses
                guess = mx.argmax(logits, axis=-1).astype(mx.uint32)
                ids = mx.concatenate([ids[:, :1], guess[None]], axis=1)
        return logits

    def propose(self, history: list[int], k: int, pick) -> tuple[mx.array | list[int], mx.array | None]:
        n = len(history)
        if k <= 0 or n < 2:
            return [], None
        self._cut(n - 1)  # rows from n - 1 on saw drafts (or not the pending id)
        if self._held() > n - 1:
            self._back_to(n - 1)
        self._add_rows(n - 1)
        if self._held() != n - 1:
            return [], None  # the target's passes have not shown this context (yet)
        logits = self.block_logits(history[-1])
        recent = mx.array(history[-HISTORY_WINDOW:], dtype=mx.uint32)
        tokens, probs = [], []
        for i in range(min(k, logits.shape[0])):
            token, q = pick(logits[i], recent)  # drawn independently: q is what it was drawn from
            tokens.append(token)
            if q is not None:
                probs.append(q)
        out = mx.concatenate(tokens)
        mx.async_eval(out)
        return out, (mx.stack(probs) if probs else None)

    def rewind(self, valid: int) -> None:
        pass  # the next pass of the target supersedes what the drafts showed (see __call__)
