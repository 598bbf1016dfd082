"""Continuous batching: the sequences that are decoding share one forward pass per step.

Each sequence prefills on its own cache (its session's, so prefix reuse works as alone),
one chunk per turn: between two chunks the batch takes a decode step, so a request that
arrives while others decode stalls them by at most one prefill chunk, and only one
sequence prefills at a time. Once its prompt (all but the last token) is in, the
sequence joins the batch: its keys and values are copied into ``BatchKVCache`` rows,
left-padded to the longest row, and its last prompt token becomes its first input. Each
step feeds every row one token, and each row is then processed, sampled and counted with
its own logits processors, sampler (and random key), log-probs and token budget. A row
that leaves (end of turn, stop string, budget, cancel) has its keys and values written
back into its own cache, so the session records them as if it had decoded alone.

The rows' positions differ, so RoPE takes one offset per row and the attention mask
hides each row's left padding. Greedy ids equal the sequence's ids alone (the masked
padding adds exact zeros; only the summation order of a wider matmul can differ).

Only families whose every layer keeps a plain ``KVCache`` and rotates with the plain
``RoPE`` batch (Llama/Mistral without a window, Qwen2, Qwen3 and Qwen3-MoE without
their sliding layers): sliding windows (rotating caches), latent attention, recurrent state
and position-dependent RoPE variants run one request at a time (``batchable``).

A sequence is a generator of ``(token, logprob)`` (``Batch.sequence``) that yields
``WAIT`` whenever it has nothing yet; whoever drives the generators calls
``Batch.step`` between rounds (the engine worker does).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.decode.guards import check_finite
from engine.decode.prefill import HISTORY_WINDOW, ProgressCallback
from engine.decode.sampling import LogitsProcessor, Sampler
from engine.models.kv_cache import DEFAULT_STEP, KVCache, make_prompt_cache

WAIT: tuple[int, float | None] = (-1, None)  # "nothing yet": the sequence waits for a step

# Families whose layers all take a per-row RoPE offset and a padding mask.
BATCHABLE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


def batchable(model: Any) -> bool:
    """Whether ``model``'s sequences can decode together (see the module's docstring)."""
    from engine.models.base import RoPE

    if getattr(model, "model_type", None) not in BATCHABLE_TYPES:
        return False
    if not all(type(c) is KVCache for c in make_prompt_cache(model)):
        return False  # a sliding window, latent or recurrent cache somewhere
    for layer in getattr(model, "layers", []):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        # Dynamic NTK and LongRoPE pick their frequencies from one scalar position.
        if rope is not None and type(rope).__call__ is not RoPE.__call__:
            return False
    return True


# Queued in place of a token when a row's logits are NaN or infinite.
NON_FINITE = (-2, None)


class BatchKVCache:
    """One layer's keys and values for all rows, shaped [rows, heads, tokens, dim] and
    left-padded: row i's tokens sit in columns ``left[i]`` to ``idx``."""

    def __init__(self, step: int = DEFAULT_STEP) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.left: list[int] = []
        self.idx = 0  # columns in use
        self.step = step
        self.offset = mx.array([], dtype=mx.int32)  # each row's next position (RoPE)

    def _refresh(self) -> None:
        self.offset = mx.array([self.idx - pad for pad in self.left], dtype=mx.int32)

    def _pad_left(self, a: mx.array, n: int) -> mx.array:
        if n == 0:
            return a
        b, h, _, d = a.shape
        return mx.concatenate([mx.zeros((b, h, n, d), a.dtype), a], axis=2)

    def add(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Append a row holding ``keys``/``values`` ([1, heads, n, dim], None for n = 0)."""
        n = 0 if keys is None else keys.shape[2]
        if self.keys is not None:
            self.keys, self.values = self.keys[..., : self.idx, :], self.values[..., : self.idx, :]
        if n > self.idx:  # the newcomer is the longest: everyone else moves right
            grow = n - self.idx
            if self.keys is not None:
                self.keys, self.values = self._pad_left(self.keys, grow), self._pad_left(self.values, grow)
            self.left = [pad + grow for pad in self.left]
            self.idx = n
        if keys is not None:
            keys, values = self._pad_left(keys, self.idx - n), self._pad_left(values, self.idx - n)
            if self.keys is None and self.left:  # rows so far held nothing
                b = len(self.left)
                self.keys = mx.zeros((b, *keys.shape[1:]), keys.dtype)
                self.values = mx.zeros((b, *values.shape[1:]), values.dtype)
            if self.keys is None:
                self.keys, self.values = keys, values
            else:
                self.keys = mx.concatenate([self.keys, keys], axis=0)
                self.values = mx.concatenate([self.values, values], axis=0)
        elif self.keys is not None:
            self.keys = mx.concatenate([self.keys, mx.zeros((1, *self.keys.shape[1:]), self.keys.dtype)], axis=0)
            self.values = mx.concatenate(
                [self.values, mx.zeros((1, *self.values.shape[1:]), self.values.dtype)], axis=0
            )
        self.left.append(self.idx - n)
        self._refresh()

    def remove(self, i: int) -> tuple[mx.array | None, mx.array | None]:
        """Take row ``i`` out; return its keys and values without padding (None if empty)."""
        pad = self.left.pop(i)
        row_k = row_v = None
        if self.keys is not None and self.idx > pad:
            row_k = self.keys[i : i + 1, :, pad : self.idx, :]
            row_v = self.values[i : i + 1, :, pad : self.idx, :]
        if not self.left:
            self.keys = self.values = None
            self.idx = 0
        elif self.keys is not None:
            keep = mx.array([j for j in range(len(self.left) + 1) if j != i])
            self.keys, self.values = self.keys[keep, :, : self.idx], self.values[keep, :, : self.idx]
            drop = min(self.left)  # columns that are padding for every row left
            if drop:
                self.keys, self.values = self.keys[..., drop:, :], self.values[..., drop:, :]
                self.left = [pad - drop for pad in self.left]
                self.idx -= drop
        self._refresh()
        return row_k, row_v

    # -- what the attention layers call ---------------------------------------------

    def make_mask(self, n_queries: int, window: int | None = None) -> Any:
        if n_queries != 1 or window is not None:
            raise ValueError("a batch decodes one token per row, without sliding windows")
        if not any(self.left):
            return None  # no padding: attend to everything, as a lone sequence does
        columns = mx.arange(self.idx + 1)[None, :]
        return (columns >= mx.array(self.left)[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        if self.keys is None or self.idx + n > self.keys.shape[2]:
            capacity = ((self.idx + n + self.step - 1) // self.step) * self.step
            b, h, _, dk = keys.shape
            new_k = mx.zeros((b, h, capacity, dk), keys.dtype)
            new_v = mx.zeros((b, h, capacity, values.shape[3]), values.dtype)
            if self.keys is not None and self.idx:
                new_k[..., : self.idx, :] = self.keys[..., : self.idx, :]
                new_v[..., : self.idx, :] = self.values[..., : self.idx, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., self.idx : self.idx + n, :] = keys
        self.values[..., self.idx : self.idx + n, :] = values
        self.idx += n
        self.offset = self.offset + n
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    @property
    def state(self) -> tuple[mx.array, ...]:
        return () if self.keys is None else (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass
class _Row:
    """One decoding sequence: its own cache (written back when it leaves) and settings."""

    cache: Sequence[Any]
    pending: mx.array  # [1]: the token it feeds next
    sample: Sampler
    processors: list[LogitsProcessor]
    recent: mx.array | None  # the ids its processors look back over
    greedy: bool
    logprobs: bool
    top_logprobs: int
    top_sink: list[tuple[mx.array, mx.array]] | None
    remaining: int  # tokens it may still produce
    out: deque[tuple[int, float | None]] = field(default_factory=deque)
    first: bool = True  # its first input is the prompt's last token, already in ``recent``
    gone: bool = False  # left the batch (budget spent, cancelled, finished)


class Batch:
    """The sequences decoding on one model, and the single prefill turn."""

    def __init__(self, model: Any, *, compiled: bool | None = None) -> None:
        """``compiled`` as in ``generate_step``: steps run through the model's compiled
        decoder (same results, less per-step overhead); None = on a GPU only."""
        self.model = model
        self.compiled = mx.default_device() == mx.gpu if compiled is None else compiled
        self._decoder: Any = None  # the CompiledDecoder, prepared for this batch's run
        self.rows: list[_Row] = []
        self.layers: list[BatchKVCache] = []
        self._turns: deque[object] = deque()  # sequences waiting to prefill, first has the turn
        self.steps = 0  # forward passes taken (for tests and benchmarks)
        self._next: mx.array | None = None  # [rows, 1]: the next input, while the rows stay the same
        self._inflight: tuple[list[_Row], mx.array, list[mx.array | None]] | None = None  # a step under way

    @property
    def active(self) -> bool:
        return bool(self.rows)

    # -- joining and leaving ------------------------------------------------------------

    def _join(self, row: _Row) -> None:
        self._settle()
        if not self.rows and self.compiled:
            from engine.decode.compiled_step import compiled_decoder

            # Prepared once per run of the batch (it retraces if adapters or weights changed).
            decoder = compiled_decoder(self.model)
            self._decoder = decoder if decoder is not None and decoder.prepare() else None
        if not self.layers:
            self.layers = [BatchKVCache() for _ in row.cache]
        for layer, c in zip(self.layers, row.cache, strict=True):
            state = c.state if c.offset else ()
            layer.add(*(state if state else (None, None)))
            c.state = ()  # the batch holds it now (memory held once); it comes back on leaving
        self.rows.append(row)
        self._next = None

    def _leave(self, row: _Row) -> None:
        if row.gone:
            return
        self._settle()  # the others keep their token from the step under way
        if row.gone:
            return
        row.gone = True
        self._next = None
        i = self.rows.index(row)
        self.rows.pop(i)
        for layer, c in zip(self.layers, row.cache, strict=True):
            k, v = layer.remove(i)
            c.state = (k, v) if k is not None else ()
        if not self.rows:
            self.layers = []

    def reset(self) -> None:
        """Drop every row (after a failed step: their caches are no longer trusted)."""
        for row in self.rows:
            row.gone = True
        self.rows, self.layers, self._next, self._inflight = [], [], None, None

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        """Hand every row the token of the step under way (starting one if none is), then
        start the next step, which the device computes while the callers read these
        tokens. A row that joins or leaves settles the step under way first."""
        if self._inflight is None:
            if not self.rows:
                return
            self._launch()
        self._settle()
        if self.rows:
            self._launch()

    def _launch(self) -> None:
        rows = list(self.rows)
        # The rows are as they were last step: feed last step's tokens as they stand.
        tokens = self._next if self._next is not None else mx.concatenate([r.pending for r in rows])[:, None]
        logits = self._decoder.rows(tokens, self.layers) if self._decoder is not None else None
        if logits is None:
            logits = self.model(tokens, cache=self.layers)[:, -1, :]
        self.steps += 1
        lps: list[mx.array | None] = [None] * len(rows)
        if all(r.greedy and not r.processors and not r.logprobs for r in rows):
            chosen = mx.argmax(logits, axis=-1)
        else:
            picked = [self._sample_row(r, logits[i : i + 1]) for i, r in enumerate(rows)]
            chosen = mx.concatenate([y.reshape(1) for y, _ in picked])
            lps = [lp for _, lp in picked]
        self._next = chosen.astype(mx.uint32)[:, None]
        # Each row's chosen raw logit rides along for the NaN check (one value per row).
        raw = mx.take_along_axis(logits, self._next.astype(mx.int32), axis=-1)[:, 0]
        mx.async_eval([self._next, raw, *(lp for lp in lps if lp is not None)])
        for i, r in enumerate(rows):
            r.first = False
            r.pending = self._next[i, :]
        self._inflight = (rows, self._next, lps, raw)

    def _settle(self) -> None:
        """Wait for the step under way and queue each row's token."""
        if self._inflight is None:
            return
        rows, chosen, lps, raw = self._inflight
        self._inflight = None
        ids = chosen[:, 0].tolist()
        finite = [math.isfinite(v) for v in raw.tolist()]
        for i, (r, lp) in enumerate(zip(rows, lps, strict=True)):
            if r.gone:
                continue
            if not finite[i]:  # damaged weights: the row's sequence raises when it reads this
                r.out.append(NON_FINITE)
                r.remaining = 0
                continue
            r.out.append((ids[i], float(lp.item()) if lp is not None else None))
            r.remaining -= 1
        for r in rows:
            if not r.gone and r.remaining <= 0:
                self._leave(r)

    def _sample_row(self, r: _Row, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        processed = logits
        if r.processors:
            if not r.first:
                r.recent = mx.concatenate([r.recent, r.pending])[-HISTORY_WINDOW:]
            for proc in r.processors:
                processed = proc(r.recent, processed)
        y = r.sample(processed)
        if not r.logprobs:
            return y, None
        raw = logits.astype(mx.float32)
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        if r.top_logprobs > 0 and r.top_sink is not None:
            k = min(r.top_logprobs, lp.shape[-1])
            top = mx.argpartition(-lp[0], kth=k - 1)[:k]
            r.top_sink.append((top, lp[0][top]))
        return y, mx.take_along_axis(lp, y[:, None], axis=-1)[0, 0]

    # -- a sequence ---------------------------------------------------------------------

    def sequence(
        self,
        prompt: mx.array,
        cache: Sequence[Any],
        *,
        max_tokens: int,
        sampler: Sampler,
        greedy: bool,
        logits_processors: Sequence[LogitsProcessor] = (),
        logprobs: bool = False,
        prefill_chunk: int = 512,
        cancel: threading.Event | None = None,
        on_progress: ProgressCallback | None = None,
        history: mx.array | None = None,
        top_logprobs: int = 0,
        top_sink: list[tuple[mx.array, mx.array]] | None = None,
    ) -> Iterator[tuple[int, float | None]]:
        """``generate_step``'s counterpart in a batch: yields ``(token, logprob)`` as the
        batch produces them, and ``WAIT`` while there is none yet."""
        if max_tokens <= 0:
            return
        cancel = cancel or threading.Event()
        turn = object()
        self._turns.append(turn)
        try:
            done, total, chunk = 0, int(prompt.size) - 1, max(1, prefill_chunk)
            while done < total:
                if cancel.is_set():
                    return
                if self._turns[0] is not turn:
                    yield WAIT
                    continue
                end = min(done + chunk, total)
                self.model(prompt[None, done:end], cache=cache)
                mx.eval([c.state for c in cache])
                done = end
                if on_progress is not None:
                    on_progress(done, total)
                yield WAIT  # the batch steps after each chunk; the turn passes on next round
        finally:
            self._turns.remove(turn)
        if cancel.is_set():
            return
        processors = list(logits_processors)
        recent = (history if history is not None else prompt)[-HISTORY_WINDOW:] if processors else None
        row = _Row(
            cache, prompt[-1:], sampler, processors, recent, greedy, logprobs, top_logprobs, top_sink, max_tokens
        )
        self._join(row)
        try:
            while True:
                if row.out:
                    item = row.out.popleft()
                    if item is NON_FINITE:
                        check_finite(float("nan"))  # raises the one-line NaN error
                    yield item
                elif row.gone or cancel.is_set():
                    return
                else:
                    yield WAIT
        finally:
            self._leave(row)
