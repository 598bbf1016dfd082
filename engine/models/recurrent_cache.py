"""The cache of a recurrent layer (gated DeltaNet, short convolution): fixed-size state.

A recurrent layer keeps, whatever the context length, the last inputs of its causal
convolution and (DeltaNet) a matrix-valued recurrent state. Unlike keys and values, that
state cannot be cut back to an earlier token: it has folded every token in. Going back
therefore means restoring a copy taken at that token. Two kinds of copies are kept:

* **per-position states of the last few tokens**, fed in passes of at most
  ``step_window`` tokens (decode steps, a speculative verification of a few drafts): the
  layer records the state after each token, and the last ``step_window`` positions are
  kept, so rejected drafts roll back exactly (``trim``). A longer pass (a prefill chunk)
  forgets them.
* **snapshots** at turn boundaries: the end of each reply (``checkpoint``, taken by the
  chat session; the last ``max_snapshots`` are kept) and the end of the latest prompt's
  prefill (``mark_prompt_end``, one, replaced by the next). A follow-up turn continues
  from the live state; editing a recent message goes back to the end of the reply before
  it; regenerating goes back to the end of the prompt.

Memory bound, per recurrent layer: ``COPIES_KEPT`` states (the live one, ``MAX_SNAPSHOTS``
reply ends, one prompt end, ``STEP_WINDOW`` recent positions), each the size of the
layer's state (``recurrent_state_bytes``). Arrays are shared, never copied (MLX arrays are
immutable), so a copy of an unchanged state costs nothing.

``trim(n)`` returns ``n`` when a copy at ``offset - n`` exists, else 0 and leaves the
cache alone; ``can_trim(n)`` asks first, so callers never trim attention layers and
fail on a recurrent one halfway.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.models.kv_cache import _mask_for, register_cache_kind  # masks follow the token count alone

# Per-position states are kept for this many recent tokens, fed in passes no longer than
# that (decode steps; a draft model feeding its last tokens and drafting; a verification).
STEP_WINDOW = 8
# Reply-end snapshots kept per cache (each a copy of the layer's state).
MAX_SNAPSHOTS = 4
# States a recurrent layer may hold: live + reply ends + one prompt end + recent positions.
COPIES_KEPT = 1 + MAX_SNAPSHOTS + 1 + STEP_WINDOW


@register_cache_kind
class RecurrentCache:
    """State arrays of one recurrent layer (``cache[i]``; None until the first token),
    the number of tokens folded in (``offset``), and the copies that allow going back."""

    def __init__(self, size: int = 2, step_window: int = STEP_WINDOW, max_snapshots: int = MAX_SNAPSHOTS):
        self.arrays: list[mx.array | None] = [None] * size
        self.offset = 0
        self.step_window = step_window
        self.max_snapshots = max_snapshots
        self._steps: dict[int, list] = {}  # offset -> arrays, the last step_window positions
        self._snapshots: dict[int, list] = {}  # offset -> arrays at reply ends, oldest first
        self._prompt_end: dict[int, list] = {}  # at most one: where the latest prefill ended

    def __getitem__(self, i: int) -> mx.array | None:
        return self.arrays[i]

    def __setitem__(self, i: int, value: mx.array | None) -> None:
        self.arrays[i] = value

    # -- the layer's side ---------------------------------------------------------

    def begin(self, n: int) -> bool:
        """A pass of ``n`` tokens starts. Returns whether the layer should record the
        state after each of them (``record``): only for short passes."""
        if n > self.step_window:
            self._steps = {}
            return False
        oldest = self.offset + n - self.step_window  # keep step_window positions after this pass
        self._steps = {k: v for k, v in self._steps.items() if k >= oldest}
        self._steps[self.offset] = list(self.arrays)
        return True

    def record(self, after: int, arrays: list) -> None:
        """The state after the first ``after`` tokens of the current pass."""
        self._steps[self.offset + after] = list(arrays)

    def advance(self, n: int) -> None:
        self.offset += n

    # -- going back -----------------------------------------------------------------

    def _copy_at(self, offset: int) -> list | None:
        if offset == self.offset:
            return list(self.arrays)
        if offset == 0:
            return [None] * len(self.arrays)
        return self._steps.get(offset) or self._snapshots.get(offset) or self._prompt_end.get(offset)

    def rewind_points(self) -> set[int]:
        """Every token count this cache can return to."""
        return {0, self.offset, *self._steps, *self._snapshots, *self._prompt_end}

    def nearest(self, limit: int) -> int:
        """The largest token count <= ``limit`` this cache can return to."""
        return max(p for p in self.rewind_points() if p <= limit)

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= self.offset and self._copy_at(self.offset - n) is not None

    def is_trimmable(self) -> bool:
        return True  # within its copies: see can_trim

    def trim(self, n: int) -> int:
        """Go back ``n`` tokens if a copy there exists; return how many were dropped."""
        if n <= 0 or not self.can_trim(n):
            return 0
        target = self.offset - n
        self.arrays = self._copy_at(target)
        self.offset = target
        # Copies past the target belong to the abandoned continuation.
        self._steps = {k: v for k, v in self._steps.items() if k <= target}
        self._snapshots = {k: v for k, v in self._snapshots.items() if k <= target}
        self._prompt_end = {k: v for k, v in self._prompt_end.items() if k <= target}
        return n

    def mark_prompt_end(self) -> None:
        """Keep a copy of the current state as the end of the latest prompt (replacing the last)."""
        self._prompt_end = {self.offset: list(self.arrays)} if self.offset else {}

    def checkpoint(self) -> None:
        """Keep a copy of the current state (the end of a reply), within ``max_snapshots``."""
        if self.offset == 0 or self.max_snapshots <= 0:
            return
        self._snapshots.pop(self.offset, None)
        self._snapshots[self.offset] = list(self.arrays)
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.pop(next(iter(self._snapshots)))

    def make_mask(self, n_queries: int, window: int | None = None):
        """The mask a full-attention layer at this token count needs (the stack computes
        masks from whichever layer comes first; a recurrent layer itself needs none)."""
        return _mask_for(self.offset, self.offset + n_queries, n_queries, window)

    # -- sizes, evaluation, save / load -------------------------------------------------

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        """Bytes of the live state (snapshots share or add at most ``max_snapshots`` more)."""
        return sum(a.nbytes for a in self.arrays if a is not None)

    @property
    def state(self) -> list[mx.array]:
        """The live arrays (what ``mx.eval`` needs after a prefill chunk)."""
        return [a for a in self.arrays if a is not None]

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> RecurrentCache:
        """An empty cache shaped as a saved one was (its number of state slots)."""
        return cls(int(meta["size"]))

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset), "size": str(len(self.arrays))}

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        self.offset = int(value.get("offset", 0))


def causal_conv(conv: nn.Conv1d, x: mx.array, cache: RecurrentCache | None, kernel: int) -> tuple[mx.array, mx.array]:
    """(conv output [B, T, C], the conv input with the K-1 earlier inputs in front).

    Without a cache the earlier inputs are zeros, as transformers pads."""
    return conv_after(conv, x, cache[0] if cache is not None else None, kernel)


def conv_after(
    conv: nn.Conv1d, x: mx.array, before: mx.array | None, kernel: int, each: bool = False
) -> tuple[mx.array, mx.array]:
    """``causal_conv`` after the earlier inputs ``before`` [B, K-1, C] (None: zeros).

    ``each`` convolves each token's window on its own, as a one-token step does: a GPU
    may run another convolution kernel for a longer input, whose sums round otherwise,
    and a speculative verification must give the numbers single steps give."""
    b, n, c = x.shape
    before = before if before is not None else mx.zeros((b, kernel - 1, c), x.dtype)
    padded = mx.concatenate([before.astype(x.dtype), x], axis=1)
    if each and n > 1:
        return mx.concatenate([conv(padded[:, t : t + kernel]) for t in range(n)], axis=1), padded
    return conv(padded), padded
