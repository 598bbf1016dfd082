"""Continuous batching: the sequences that are decoding share one forward pass per step.

A sequence first waits to prefill. Waiting sequences prefill together, up to
``PREFILL_ROWS`` at a time, straight into the rows of a prefill ``BatchKVCache``: each
row starts from what its session already holds (prefix reuse, left-padded to the longest)
and feeds its next tokens, right-padded to the widest. The rows of one prefill pass
share one chunk's worth of tokens (``prefill_chunk`` over the number of rows), and the
batch runs one such pass per step, so a request that arrives while others decode stalls
them by at most one prefill chunk. A row whose prompt (all but its last token) is in
leaves the prefill rows at once, its right padding cut off, and joins the decoding rows
(left-padded to the longest); its last prompt token becomes its first input.

Each decode step feeds every row one token. It is pipelined like the single-stream loop:
step n+1 is queued (``mx.async_eval``) before the tokens of step n are read, and rows
join and leave with lazy gathers, without waiting for the step under way. Rows that
decode greedily without logits processors are picked with one argmax over the batch and
every requested log-prob comes from one log-softmax; a row with its own sampler (random
key) or processors is processed and sampled on its own. A row that leaves (end of turn,
stop string, budget, cancel) has its keys and values written back into its own cache, so
the session records them as if it had decoded alone.

The rows' positions differ, so RoPE takes one offset per row and the attention mask
hides each row's left padding (no mask at all when no row is padded, as when prompts of
one length prefill together). Greedy ids equal the sequence's ids alone (the masked
padding adds exact zeros; only the summation order of a wider matmul can differ). On a
GPU the step runs through the compiled decoder (``CompiledDecoder.rows``).

Before a sequence starts to prefill, its KV cache at full length (its prompt plus its
token budget) must fit the room the memory budget leaves (``Batch.kv_room``); otherwise
it waits for running sequences to leave, and is refused (``OutOfKVRoom``) when nothing
else is running.

Only families whose every layer keeps a plain ``KVCache`` (or a paged one: a row gathers
its blocks on joining and writes its keys and values back into blocks on leaving; rows
starting with the same published blocks, a shared system prompt, leave those in the pool
and attend over one copy of them, engine/decode/batch_cache.py) and
rotates with the plain ``RoPE`` batch (Llama/Mistral without a window, Qwen2, Qwen3 and Qwen3-MoE without
their sliding layers): sliding windows (rotating caches), latent attention, recurrent state
and position-dependent RoPE variants run one request at a time (``batchable``).

A sequence is a generator of ``(token, logprob)`` (``Batch.sequence``) that yields
``WAIT`` whenever it has nothing yet; whoever drives the generators calls
``Batch.step`` between rounds (the engine worker does).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.decode.batch_cache import MAX_PREFIXES, NO_PREFIX, BatchKVCache
from engine.decode.guards import check_finite
from engine.decode.prefill import HISTORY_WINDOW, ProgressCallback, common_prefix_length
from engine.decode.sampling import LogitsProcessor, Sampler
from engine.decode.signals import Signal, Token
from engine.errors import OutOfKVRoom
from engine.models.base import AttentionSteps
from engine.models.families import FAMILIES
from engine.models.kv_cache import KVCache, make_prompt_cache
from engine.models.paged_kv import PagedKVCache, fresh_block_size, sequence_of, shared_blocks

WAIT = Signal.WAITING  # "nothing yet": the sequence waits for a step

# Families whose layers all take a per-row RoPE offset and a padding mask (the family
# manifest's ``batches``).
BATCHABLE_TYPES = frozenset(t for t, f in FAMILIES.items() if f.batches)

# Sequences prefilling together at most (mlx-lm's server prefills 8 at a time too).
PREFILL_ROWS = 8


def batchable(model: Any) -> bool:
    """Whether ``model``'s sequences can decode together (see the module's docstring)."""
    from engine.models.base import RoPE

    if getattr(model, "model_type", None) not in BATCHABLE_TYPES:
        return False
    if not all(type(c) in (KVCache, PagedKVCache) for c in make_prompt_cache(model)):
        return False  # a sliding window, latent or recurrent cache somewhere
    for layer in getattr(model, "layers", []):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        # Dynamic NTK and LongRoPE pick their frequencies from one scalar position.
        if rope is not None and type(rope).__call__ is not RoPE.__call__:
            return False
    return True


# Queued in place of a token when a row's logits are NaN or infinite.
NON_FINITE = Signal.NON_FINITE


@dataclass
class _Row:
    """One sequence: its own cache (written back when it leaves) and settings."""

    cache: Sequence[Any]
    prompt: list[int]  # the ids to prefill (all but the prompt's last)
    pending: mx.array  # [1]: the token it feeds first (the prompt's last)
    sample: Sampler
    processors: list[LogitsProcessor]
    recent: mx.array | None  # the ids its processors look back over
    greedy: bool
    logprobs: bool
    top_logprobs: int
    top_sink: list[tuple[mx.array, mx.array]] | None
    max_tokens: int
    chunk: int
    on_progress: ProgressCallback | None
    need_bytes: int = 0  # its KV cache at full length (admission)
    done: int = 0  # prompt ids prefilled so far
    queued: int = 0  # tokens it was given steps for (delivered or under way)
    out: deque[Token | Signal] = field(default_factory=deque)
    first: bool = True  # its first input is the prompt's last token, already in ``recent``
    fresh: int = 0  # its cache was an empty shareable paged one: the block size (``fresh_block_size``)
    after: _Row | None = None  # waiting for that row's prefill of the whole blocks their prompts share
    where: str = "waiting"  # waiting, prefill, decode, gone
    error: Exception | None = None  # refused before it started (raised by its sequence)

    @property
    def plain(self) -> bool:
        """Picked by the batch's one argmax: greedy and nothing processes its logits."""
        return self.greedy and not self.processors


@dataclass
class StepTimes:
    """Where a batch's time goes (seconds, summed; for profiling on the device)."""

    launches: int = 0
    launch_s: float = 0.0  # building a decode step's graph and queueing it
    settle_s: float = 0.0  # waiting for a step's tokens and handing them out
    sample_s: float = 0.0  # of launch_s: building the picking (argmax, samplers, log-probs)
    queue_s: float = 0.0  # of launch_s: handing the step to the device (mx.async_eval)
    masked: int = 0  # decode steps whose rows had left padding (an array mask: a slower attention path)
    prefills: int = 0
    prefill_s: float = 0.0  # prefill passes on the host: building, queueing, waiting for the pass before
    prefill_tokens: int = 0
    rows_stepped: int = 0  # rows summed over decode steps (mean batch width = / launches)


@dataclass
class _Step:
    """A decode step under way: its rows and what they read when it settles."""

    rows: list[_Row]
    chosen: mx.array  # [rows]
    raw: mx.array  # [rows]: each row's chosen raw logit (the NaN check)
    logprobs: mx.array | None  # [rows] where some row asked for them
    extra: list[mx.array | None]  # per row: its top log-prob ids, when it asked for them


class Batch:
    """The sequences decoding on one model, and those prefilling to join them."""

    def __init__(
        self,
        model: Any,
        *,
        compiled: bool | None = None,
        kv_room: Callable[[int], int] | None = None,
        kv_bytes_per_token: int = 0,
        prefill_rows: int = PREFILL_ROWS,
    ) -> None:
        """``compiled`` as in ``generate_step``: steps run through the model's compiled
        decoder (same results, less per-step overhead); None = on a GPU only.
        ``kv_room(needed)`` gives the bytes the memory budget leaves for the batch's KV
        caches (freeing idle ones when that is short of ``needed``) and ``kv_bytes_per_token``
        what one token costs; without them nothing is checked."""
        self.model = model
        self.compiled = mx.default_device() == mx.gpu if compiled is None else compiled
        self.kv_room = kv_room
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_rows = max(1, prefill_rows)
        # A shared prefix is attended apart from each row's tokens, which only the plain
        # attention allows (no sinks or soft caps: engine/decode/batch_cache.py).
        self.shares_prefixes = all(
            getattr(type(getattr(layer, "self_attn", None)), "attend", None) is AttentionSteps.attend
            for layer in getattr(model, "layers", [])
        )
        self._decoder: Any = None  # the CompiledDecoder, prepared for this batch's run
        self.rows: list[_Row] = []  # decoding, in cache row order
        self.layers: list[BatchKVCache] = []
        self.filling: list[_Row] = []  # prefilling together, in prefill cache row order
        self.fill_layers: list[BatchKVCache] = []
        self.waiting: deque[_Row] = deque()  # not yet prefilling
        self.steps = 0  # decode forward passes taken (for tests and benchmarks)
        self.prefills = 0  # prefill forward passes taken
        self.times = StepTimes()
        self._next: mx.array | None = None  # [rows, 1]: each decoding row's next input
        self._inflight: _Step | None = None  # the step under way
        self._fill_queued: list[mx.array] | None = None  # what the prefill pass under way computes

    @property
    def active(self) -> bool:
        return bool(self.rows or self.filling or self.waiting)

    @property
    def nbytes(self) -> int:
        """KV bytes the batch holds (decoding and prefilling rows)."""
        return sum(layer.nbytes for layer in (*self.layers, *self.fill_layers))

    # -- admission ----------------------------------------------------------------------

    def _admit(self, row: _Row) -> bool:
        """Whether ``row``'s KV at full length fits beside the rows already admitted;
        refuses it (``row.error``) when it cannot fit even alone."""
        if self.kv_room is None or not self.kv_bytes_per_token:
            return True
        held = sum(r.need_bytes for r in (*self.rows, *self.filling))
        room = self.kv_room(held + row.need_bytes)
        if held + row.need_bytes <= room:
            return True
        if held == 0:  # nothing else runs: waiting would not help
            tokens = row.need_bytes // self.kv_bytes_per_token
            row.error = OutOfKVRoom(
                f"This request's KV cache at its full length ({tokens:,} tokens) needs "
                f"{row.need_bytes / 1e6:,.1f} MB, but the memory budget leaves {max(room, 0) / 1e6:,.1f} MB "
                "for KV caches; lower max_tokens, shorten the prompt, or raise the memory budget."
            )
            return True  # taken off the queue: its sequence raises the error
        return False

    # -- joining and leaving ------------------------------------------------------------

    def _join(self, row: _Row) -> None:
        """Row (its cache holding its whole prompt but the last id) starts decoding."""
        if not self.rows and self.compiled:
            from engine.decode.compiled_step import compiled_decoder

            # Prepared once per run of the batch (it retraces if adapters or weights changed).
            decoder = compiled_decoder(self.model)
            self._decoder = decoder if decoder is not None and decoder.prepare() else None
        if not self.layers:
            self.layers = [BatchKVCache() for _ in row.cache]
        self._hand_over(self.layers, row)
        first = row.pending.astype(mx.uint32)[:, None]
        self._next = first if self._next is None else mx.concatenate([self._next, first])
        self.rows.append(row)
        row.where = "decode"

    def _hand_over(self, layers: list[BatchKVCache], row: _Row) -> None:
        """Row's keys and values into ``layers`` as their last row, its cache keeping only
        what the batch does not hold: one of the batch's shared prefixes, the longest its
        paged cache starts with (the row's own published blocks become a new one when none
        matches and the batch has room), else nothing (memory held once either way)."""
        run, tokens = shared_blocks(row.cache) if self.shares_prefixes else ((), 0)
        top = layers[0]
        j = top.prefix_for(run) if run else NO_PREFIX
        if run and j == NO_PREFIX and len(top.prefixes) < MAX_PREFIXES:
            for layer, c in zip(layers, row.cache, strict=True):
                j = layer.share(run, *c.leading(tokens))
        if j != NO_PREFIX:
            held = top.prefix_len(j)
            for layer, c in zip(layers, row.cache, strict=True):
                layer.add(*(c.split_off(held) or (None, None)), sees=j)
            return
        for layer, c in zip(layers, row.cache, strict=True):
            state = c.state if c.offset else ()
            layer.add(*(state if state else (None, None)))
            c.state = ()  # the batch holds it now; it comes back on leaving

    def _take_back(self, layers: list[BatchKVCache], i: int, row: _Row, trailing: int = 0) -> None:
        """Row ``i`` out of ``layers``, its keys and values back into its cache (after the
        prefix it kept, when it saw the batch's shared prefix)."""
        sees = layers[0].sees[i] != NO_PREFIX
        taken: list[mx.array] = []
        for layer, c in zip(layers, row.cache, strict=True):
            k, v = layer.remove(i, trailing)
            if k is not None:
                taken += [k, v]
            if sees:
                if k is not None:
                    c.extend(k, v)
            else:
                c.state = (k, v) if k is not None else ()
        if taken:
            mx.async_eval(taken)  # the row's own copies (``remove``), computed without waiting

    def _enter_prefill(self, row: _Row) -> None:
        if not self.fill_layers:
            self.fill_layers = [BatchKVCache() for _ in row.cache]
        self._hand_over(self.fill_layers, row)
        self.filling.append(row)
        row.where = "prefill"

    def _out_of_prefill(self, row: _Row, trailing: int = 0) -> None:
        i = self.filling.index(row)
        self.filling.pop(i)
        self._take_back(self.fill_layers, i, row, trailing)
        self._lend(row)
        if not self.filling:
            self.fill_layers = []

    # -- rows arriving together with one prompt prefill it once --------------------------

    def _waits_for_common_prompt(self, row: _Row) -> bool:
        """Whether ``row`` (an empty paged cache) starts with whole blocks of the prompt a
        fresh row is prefilling now: then it waits for that prefill and borrows those blocks
        (``_lend``), where prefilling beside it would compute them twice and share the pass."""
        if not row.fresh:
            return False
        for other in self.filling:
            if other.fresh == row.fresh and sequence_of(other.cache).pool is sequence_of(row.cache).pool:  # type: ignore[union-attr]
                if common_prefix_length(row.prompt, other.prompt) >= row.fresh:
                    row.after = other
                    return True
        return False

    def _lend(self, row: _Row) -> None:
        """``row`` is out of prefill: the rows waiting for its prompt take the blocks it has
        prefilled (all of them unless it was cancelled) and go on from there."""
        borrowers = [r for r in self.waiting if r.after is row]
        if not borrowers:
            return
        lender = sequence_of(row.cache)
        assert lender is not None
        lender.drop_views()  # its tokens into blocks (the view itself, adopted: no copy)
        for r in borrowers:
            r.after = None
            sequence = sequence_of(r.cache)
            assert sequence is not None
            common = min(common_prefix_length(r.prompt, row.prompt), row.done)  # all of it unless cancelled
            r.done = sequence.borrow(lender, common // r.fresh)
            r.fresh = 0  # its cache holds a prefix now
            if r.on_progress is not None:
                r.on_progress(r.done, len(r.prompt))

    def _leave(self, row: _Row) -> None:
        """Take ``row`` out wherever it is; its cache gets back what the batch held of it.
        Lazy: a step under way keeps computing it, and its token is dropped."""
        where, row.where = row.where, "gone"
        if where == "waiting":
            self.waiting.remove(row)
        elif where == "prefill":
            self._out_of_prefill(row)
        elif where == "decode":
            i = self.rows.index(row)
            self.rows.pop(i)
            self._take_back(self.layers, i, row)
            if not self.rows:
                self.layers, self._next = [], None
            elif self._next is not None:
                self._next = self._next[mx.array([j for j in range(len(self.rows) + 1) if j != i])]

    def reset(self) -> None:
        """Drop every row (after a failed step: their caches are no longer trusted)."""
        for row in (*self.rows, *self.filling, *self.waiting):
            row.where = "gone"
        self.rows, self.layers, self._next, self._inflight = [], [], None, None
        self.filling, self.fill_layers, self.waiting, self._fill_queued = [], [], deque(), None

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        """Queue the next decode step (rows whose budget the steps under way fill leave
        first), run one prefill pass for the sequences waiting to join, then hand every
        row its token from the previous step: the device computes the new step while
        the callers read those tokens."""
        previous, self._inflight = self._inflight, None
        for row in [r for r in self.rows if r.queued >= r.max_tokens]:
            self._leave(row)  # its last token is in ``previous``; alone it would stop here too
            row.where = "done"
        if self.rows:
            self._launch()
        self._prefill_pass()
        if previous is not None:
            self._settle(previous)

    def _launch(self) -> None:
        start = time.perf_counter()
        rows = list(self.rows)
        tokens = self._next
        assert tokens is not None
        logits = self._decoder.rows(tokens, self.layers) if self._decoder is not None else None
        if logits is None:
            logits = self.model(tokens, cache=self.layers)[:, -1, :]
        self.steps += 1
        picked = time.perf_counter()
        step = self._pick(rows, tokens, logits)
        self._next = step.chosen[:, None]
        extra = [a for a in step.extra if a is not None]
        queued = time.perf_counter()
        mx.async_eval([step.chosen, step.raw, *([step.logprobs] if step.logprobs is not None else []), *extra])
        for r in rows:
            r.first = False
            r.queued += 1
        self._inflight = step
        end = time.perf_counter()
        t = self.times
        t.launches += 1
        t.rows_stepped += len(rows)
        t.launch_s += end - start
        t.sample_s += queued - picked
        t.queue_s += end - queued
        t.masked += any(self.layers[0].left)

    def _pick(self, rows: list[_Row], tokens: mx.array, logits: mx.array) -> _Step:
        """Each row's next token: one argmax for the plain rows, their own sampler and
        processors for the rest; one log-softmax for every row that wants log-probs."""
        chosen = mx.argmax(logits, axis=-1)  # every row's, kept for the plain ones
        others = [i for i, r in enumerate(rows) if not r.plain]
        if others:
            picks = self._sample_rows(rows, others, tokens, logits)
            chosen[mx.array(others)] = mx.concatenate(picks).astype(chosen.dtype)
        chosen = chosen.astype(mx.uint32)
        lp = None
        extra: list[mx.array | None] = [None] * len(rows)
        if any(r.logprobs for r in rows):
            raw = logits.astype(mx.float32)
            lps = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            lp = mx.take_along_axis(lps, chosen[:, None].astype(mx.int32), axis=-1)[:, 0]
            for i, r in enumerate(rows):
                if r.logprobs and r.top_logprobs > 0 and r.top_sink is not None:
                    k = min(r.top_logprobs, lps.shape[-1])
                    top = mx.argpartition(-lps[i], kth=k - 1)[:k]
                    r.top_sink.append((top, lps[i][top]))
                    extra[i] = top
        # Each row's chosen raw logit rides along for the NaN check (one value per row).
        raw_chosen = mx.take_along_axis(logits, chosen[:, None].astype(mx.int32), axis=-1)[:, 0]
        return _Step(rows, chosen, raw_chosen, lp, extra)

    def _sample_rows(self, rows: list[_Row], which: list[int], tokens: mx.array, logits: mx.array) -> list[mx.array]:
        """The tokens of rows ``which`` (in that order). Rows without processors whose
        samplers share their filter settings are filtered in one call, then each draws
        with its own key; the rest go one by one."""
        picks: dict[int, mx.array] = {}
        shared: dict[Any, list[int]] = {}
        for i in which:
            key = getattr(rows[i].sample, "filter_key", None)
            if key is not None and not rows[i].processors:
                shared.setdefault(key, []).append(i)
        for group in shared.values():
            if len(group) < 2:
                continue
            kept = rows[group[0]].sample.filtered(logits[mx.array(group)])  # type: ignore[attr-defined]
            for j, i in enumerate(group):
                picks[i] = rows[i].sample.draw(kept[j : j + 1]).reshape(1)  # type: ignore[attr-defined]
        return [picks[i] if i in picks else self._sample_row(rows[i], tokens[i], logits[i : i + 1]) for i in which]

    def _sample_row(self, r: _Row, token: mx.array, logits: mx.array) -> mx.array:
        processed = logits
        if r.processors:
            if not r.first:
                r.recent = mx.concatenate([r.recent, token])[-HISTORY_WINDOW:]
            for proc in r.processors:
                processed = proc(r.recent, processed)
        return r.sample(processed).reshape(1)

    def _settle(self, step: _Step) -> None:
        """Wait for ``step`` and queue each row's token."""
        start = time.perf_counter()
        ids = step.chosen.tolist()
        finite = [math.isfinite(v) for v in step.raw.tolist()]
        lps = step.logprobs.tolist() if step.logprobs is not None else None
        for i, r in enumerate(step.rows):
            if r.where == "gone":
                continue
            if not finite[i]:  # damaged weights: the row's sequence raises when it reads this
                r.out.append(NON_FINITE)
                r.max_tokens = 0  # the next step leaves it out
                continue
            r.out.append((ids[i], lps[i] if lps is not None and r.logprobs else None))
        self.times.settle_s += time.perf_counter() - start

    # -- prefill ------------------------------------------------------------------------

    def _prefill_pass(self) -> None:
        """Admit waiting sequences (as memory allows) and feed the prefilling rows one
        chunk's worth of their prompts; rows whose prompt is in start decoding."""
        for row in list(self.waiting):
            if len(self.filling) >= self.prefill_rows:
                break
            if row.after is not None or self._waits_for_common_prompt(row):
                continue
            if not self._admit(row):
                break
            self.waiting.remove(row)
            if row.error is not None:
                row.where = "gone"
                continue
            if row.done >= len(row.prompt):
                self._join(row)
            else:
                self._enter_prefill(row)
        if not self.filling:
            return
        start = time.perf_counter()
        if self._fill_queued is not None:
            # One pass in flight at most: a cancel then stops the prefill within a chunk,
            # where queueing every pass at once would leave the device a whole prompt to do.
            mx.eval(self._fill_queued)
            self._fill_queued = None
        rows = list(self.filling)
        # One chunk's worth of tokens in all: the rows share it (a [rows, width] pass does
        # as much matmul work per launch as a [1, chunk] one).
        width = max(1, min(r.chunk for r in rows) // len(rows))
        takes = [min(width, len(r.prompt) - r.done) for r in rows]
        wide = max(takes)
        ids = [r.prompt[r.done : r.done + n] + [0] * (wide - n) for r, n in zip(rows, takes, strict=True)]
        self.model(mx.array(ids, dtype=mx.uint32), cache=self.fill_layers)
        self._fill_queued = [a for layer in self.fill_layers for a in layer.pending_arrays()]
        mx.async_eval(self._fill_queued)
        self.prefills += 1
        self.times.prefills += 1
        self.times.prefill_tokens += sum(takes)
        for r, n in zip(rows, takes, strict=True):
            r.done += n
            if r.on_progress is not None:
                r.on_progress(r.done, len(r.prompt))
        for r, n in zip(rows, takes, strict=True):
            if r.done >= len(r.prompt):
                self._out_of_prefill(r, trailing=wide - n)
                self._join(r)
        if not self.filling:
            self._fill_queued = None  # nothing waits on it, and it holds the prefill rows' buffers
        self.times.prefill_s += time.perf_counter() - start

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
    ) -> Iterator[Token | Signal]:
        """``generate_step``'s counterpart in a batch: yields ``(token, logprob)`` as the
        batch produces them, and ``WAIT`` while there is none yet."""
        if max_tokens <= 0:
            return
        cancel = cancel or threading.Event()
        processors = list(logits_processors)
        recent = (history if history is not None else prompt)[-HISTORY_WINDOW:] if processors else None
        ids = prompt.tolist()
        held = cache[0].offset if cache else 0
        row = _Row(
            cache,
            ids[:-1],
            prompt[-1:],
            sampler,
            processors,
            recent,
            greedy,
            logprobs,
            top_logprobs,
            top_sink,
            max_tokens,
            max(1, prefill_chunk),
            on_progress,
            need_bytes=(held + len(ids) + max_tokens) * self.kv_bytes_per_token,
            fresh=fresh_block_size(cache) if self.shares_prefixes else 0,
        )
        self.waiting.append(row)
        try:
            while True:
                if row.out:
                    item = row.out.popleft()
                    if item is NON_FINITE:
                        check_finite(float("nan"))  # raises the one-line NaN error
                    yield item
                elif row.error is not None:
                    raise row.error
                elif row.where in ("gone", "done") or cancel.is_set():
                    return
                else:
                    yield WAIT
        finally:
            if row.where not in ("gone", "done"):
                self._leave(row)
