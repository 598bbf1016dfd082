"""Routed experts streamed from the checkpoint: a slab of expert slots per MoE layer.

A streamed MoE layer (``SwitchGLU``) holds its stacked expert arrays with ``slots`` rows
instead of one row per expert: the slab. ``ExpertLayer`` maps experts to slots (least
recently used goes first) and, when the router picks an expert that is not in the slab,
reads only that expert's bytes from the safetensors file (``ExpertSource`` knows the
byte range of each expert in each stored tensor, whatever the layout) and writes them
into a slot. The router's expert ids are then remapped to slot ids and the ordinary
``gather_mm``/``gather_qmm`` runs over the slab, so each token meets exactly the weights,
kernels and order of operations of the fully resident model.

When one pass needs more distinct experts than the layer has slots (a long prefill over a
small slab), its experts are taken in groups of at most ``slots``: each group is loaded,
the pass runs with the other experts masked, and the groups' outputs are merged. Each
missing expert is still read once per pass.

File reads run on reader threads (``ExpertStore``): they only read bytes into numpy
buffers; every MLX call stays on the engine thread. Reads are started a layer or two
before the experts are needed, so a step waits only for what was not foreseen:

- **The next layer's router, one layer early.** A decode or verify pass (a few tokens)
  asks the next layer's router what it would pick for this layer's input, in the same
  evaluation as this layer's own choice. In a trained model the residual stream changes
  little from one layer to the next, so the guess is mostly right; each layer measures how
  often it is, and its guesses are read (on the threads a pass waits on: they would be
  waited for one layer later anyway) only while they are right often enough.
- **Recent frequency, two layers early.** Experts of the layer after that which were
  routed in most passes lately, and are not in its slab, are read on threads of their own,
  so a wrong guess never delays a read a pass waits for.

A guess costs disk time whether or not it is routed, and on a disk-bound step that time is
taken from the reads the step needs: so only likely experts are guessed, and each layer
scores each way of guessing (``Guesses``: the share of its guesses outside the slab, each a
read, that the layer's pass then routed). A way that has lately been right less than half
the time is still scored but not read. A checkpoint file
that changed or vanished since the load is noticed before any read and raised as
``ExpertFileChanged``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import ModelLoadError

# How far ahead the reader looks (layers) and how many experts per layer it guesses.
PREFETCH_LAYERS = 2
# Passes of at most this many tokens ask the next layer's router for a guess (a prefill
# chunk routes to most experts anyway, and its guess would cost a matmul of its own).
ROUTER_GUESS_TOKENS = 16
# A layer's guesses of one kind are read only while the share of them its passes then
# routed (decayed like the frequencies; counting only guesses outside the slab, those a
# read would fetch) is at least this. Trained models keep the residual stream close from
# layer to layer, so their routers guess mostly right; random weights do not: on the H200,
# gpt-oss-20b's shape with random weights had 69% of all router guesses right, yet reading
# those outside the slab read 340 MB unused per 66 MB needed at a quarter resident, and
# frequency guesses read 242 MB unused.
GUESS_MIN_RIGHT = 0.5
# Read-ahead buffers kept at most per layer: past it the oldest guess is dropped.
MAX_PREFETCHED = 16
# Each call multiplies the routing counts by this: "recent" frequency.
FREQUENCY_DECAY = 0.8
# A guess is read ahead only when the expert's recent routing rate (its decayed count times
# 1 - FREQUENCY_DECAY: routed in every pass lately gives 1) reaches this: routed in the last
# two passes qualifies, once in the last few does not. On the CPU bench (small-moe, an eighth
# resident) guessing every recently routed expert read 0.8 bytes ahead and unused for each
# byte routed.
GUESS_MIN_RATE = 0.3
READER_THREADS = 4  # reads a pass waits for
AHEAD_THREADS = 2  # guesses
WARM_BATCH = 16  # experts read at a time while the slabs are first filled

_MX_DTYPES = {
    "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32,
    "U32": mx.uint32, "U8": mx.uint8, "I32": mx.int32, "U16": mx.uint16, "I8": mx.int8,
}  # fmt: skip


class ExpertFileChanged(ModelLoadError):
    """A checkpoint file the experts stream from changed or vanished after the load."""


@dataclass(frozen=True)
class ExpertSource:
    """Where one stacked expert parameter's rows are stored.

    ``offsets[e]`` is (file, byte offset) of expert e's ``nbytes`` bytes, which hold one
    array of ``dtype`` and ``shape`` as stored; ``transform`` turns a stack of such arrays
    [n, *shape] into the slab's layout (a half of a fused gate/up, interleaved rows,
    transposed, packed bytes seen as words), or None when they are already that."""

    offsets: tuple[tuple[str, int], ...]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    transform: Callable[[mx.array], mx.array] | None = None

    def decode(self, raw: np.ndarray) -> mx.array:
        """Rows [n, ...] as the slab holds them from raw bytes [n, nbytes]."""
        n = raw.shape[0]
        a = mx.array(raw).view(_MX_DTYPES[self.dtype]).reshape(n, *self.shape)
        return self.transform(a) if self.transform is not None else a

    def row_shape(self) -> tuple[int, ...]:
        """One expert's shape in the slab, worked out without reading anything."""
        blank = mx.zeros((1, *self.shape), dtype=_MX_DTYPES[self.dtype])
        return tuple((self.transform(blank) if self.transform is not None else blank).shape[1:])


class ExpertStats:
    """What streaming did: lookups of an expert in its layer's slab, hits, bytes read."""

    def __init__(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.read_bytes = 0
        self.read_ahead = 0  # misses whose bytes a reader had fetched before they were asked for
        self.wasted_bytes = 0  # bytes read ahead for a guess the layer's pass did not route
        # Guesses outside the slab (each would be a read), and those the layer's pass then
        # routed: by the next layer's router (a decode or verify pass), and by frequency.
        self.router_guesses = 0
        self.router_right = 0
        self.frequency_guesses = 0
        self.frequency_right = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0


class Guesses:
    """One way of guessing a layer's experts before its router runs: this pass's guesses
    outside the slab, and the recent share of such guesses that the layer then routed."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.right = 1.0  # trusted until shown wrong

    @property
    def trusted(self) -> bool:
        return self.right >= GUESS_MIN_RIGHT

    def score(self, ids: np.ndarray) -> tuple[int, int]:
        """The pass routed ``ids``: (guesses scored, of them right), and the share updated."""
        if not self.pending:
            return 0, 0
        n, hit = len(self.pending), int(np.isin(np.fromiter(self.pending, np.int64), ids).sum())
        self.right = FREQUENCY_DECAY * self.right + (1 - FREQUENCY_DECAY) * hit / n
        self.pending = set()
        return n, hit


class ExpertLayer:
    """One MoE layer's slab: which expert each slot holds and how to fill a slot."""

    def __init__(
        self,
        store: ExpertStore,
        index: int,
        glu: Any,
        num_experts: int,
        slots: int,
        sources: dict[str, ExpertSource],
        choose: Callable[[mx.array], mx.array] | None = None,
    ):
        self.store, self.index, self.glu = store, index, glu
        self.choose = choose  # the router's choice alone (the routing block's ``choose_experts``)
        self.by_router = Guesses()  # the router's choice one layer early
        self.by_frequency = Guesses()  # experts routed in most passes lately
        self.num_experts, self.slots = num_experts, slots
        self.sources = sources
        self.files = sorted({file for source in sources.values() for file, _ in source.offsets})
        self.slot_of = np.full(num_experts, -1, dtype=np.int32)
        self.held = np.full(slots, -1, dtype=np.int64)  # the expert in each slot, -1 for none
        self.recent: OrderedDict[int, None] = OrderedDict()  # resident experts, least recent first
        self.frequency = np.zeros(num_experts, dtype=np.float64)
        self.slot_experts = mx.zeros((slots,), dtype=mx.int32)  # self.held for the device

    @property
    def slab_bytes(self) -> int:
        return sum(self._slab(name).nbytes for name in self.sources)

    def _slab(self, name: str) -> mx.array:
        proj, leaf = name.split(".")
        return self._projection(proj)[leaf]

    def _projection(self, proj: str) -> Any:
        """The stacked projection itself, under the adapter host mounted on it if any."""
        module = self.glu[proj]
        return getattr(module, "base", module)

    def _point_adapters(self) -> None:
        # Adapters on the experts (lora.SwitchLoRAHost) gather their deltas by expert: tell
        # them which expert each slot holds (an empty slot reads as expert 0; nothing routes there).
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = self.glu[proj]
            if hasattr(module, "slot_experts"):  # a plain attribute, not a parameter of the model
                object.__setattr__(module, "slot_experts", self.slot_experts)

    def run(self, x: mx.array, indices: mx.array) -> mx.array:
        """The experts' outputs for ``indices`` (expert ids), computed over the slab."""
        foreseen = self.store.next_choice(self, x)
        if foreseen is not None:
            mx.eval(indices, foreseen)  # one evaluation for both
            foreseen = np.array(foreseen)
        ids = np.array(indices).astype(np.int64)
        self.store.routed(self, ids, foreseen)
        try:
            return self._run(x, ids)
        finally:
            self.store.forget_guesses(self)  # read for this pass or never: the next pass guesses anew

    def _run(self, x: mx.array, ids: np.ndarray) -> mx.array:
        chosen = np.unique(ids)
        if len(chosen) <= self.slots:
            self.ensure(chosen)
            self._point_adapters()
            return self.glu.routed(x, mx.array(self.slot_of[ids]))
        # More experts than slots: a group at a time, each pair (token, expert) taking its
        # own group's output; evaluated before the next group rewrites the slab.
        y = None
        for start in range(0, len(chosen), self.slots):
            group = chosen[start : start + self.slots]
            self.ensure(group)
            self._point_adapters()
            lookup = np.zeros(self.num_experts, dtype=np.int32)
            lookup[group] = self.slot_of[group]
            part = self.glu.routed(x, mx.array(lookup[ids]))
            if y is None:
                y = part
            else:
                inside = mx.array(np.isin(ids, group)).reshape(*ids.shape, *([1] * (part.ndim - ids.ndim)))
                y = mx.where(inside, part, y)
            mx.eval(y)
        return y

    def ensure(self, experts: np.ndarray) -> None:
        """Put ``experts`` (distinct, at most ``slots``) in the slab, reading the missing ones."""
        stats = self.store.stats
        stats.lookups += len(experts)
        missing = [int(e) for e in experts if self.slot_of[e] < 0]
        stats.hits += len(experts) - len(missing)
        for e in experts:
            if self.slot_of[e] >= 0:
                self.recent.move_to_end(int(e))
        if missing:
            self.load(missing, keep={int(e) for e in experts})

    def load(self, experts: Sequence[int], keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Read ``experts`` into free or least recently used slots (never those of ``keep``)."""
        raw = self.store.fetch(self, experts)
        slots = self._claim(len(experts), keep)
        where = mx.array(np.array(slots, dtype=np.int32))
        written = []
        for name, source in self.sources.items():
            slab = self._slab(name)
            slab[where] = source.decode(raw[name]).astype(slab.dtype)
            written.append(slab)
        mx.eval(written)
        for e, slot in zip(experts, slots):
            old = int(self.held[slot])
            if old >= 0:
                self.slot_of[old] = -1
                self.recent.pop(old, None)
            self.held[slot] = e
            self.slot_of[e] = slot
            self.recent[e] = None
        self.slot_experts = mx.array(np.maximum(self.held, 0).astype(np.int32))

    def _claim(self, n: int, keep: set[int] | frozenset[int]) -> list[int]:
        free = [int(s) for s in np.flatnonzero(self.held < 0)[:n]]
        if len(free) < n:
            victims = [e for e in self.recent if e not in keep][: n - len(free)]
            free += [int(self.slot_of[e]) for e in victims]
        if len(free) < n:
            raise RuntimeError(f"{n} experts asked of a slab of {self.slots} slots")
        return free

    def guesses(self, count: int) -> list[int]:
        """Up to ``count`` experts not in the slab that were routed in most passes lately."""
        likely = self.frequency * (1 - FREQUENCY_DECAY) >= GUESS_MIN_RATE
        order = np.argsort(-self.frequency, kind="stable")
        picks = [int(e) for e in order[: count * 2] if likely[e] and self.slot_of[e] < 0]
        return picks[:count]


class ExpertStore:
    """Every streamed layer of a model, the reader threads, and the counters."""

    def __init__(self, files: Sequence[str], top_k: int):
        self.layers: list[ExpertLayer] = []
        self.stats = ExpertStats()
        self.top_k = max(1, top_k)
        self.prefetch = True
        self._files = {f: _identity(f) for f in files}
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="expert-reader")
        self._ahead: ThreadPoolExecutor | None = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="expert-guess")
        self._pending: dict[int, OrderedDict[int, Future]] = {}  # layer -> expert -> its read

    @property
    def slab_bytes(self) -> int:
        return sum(layer.slab_bytes for layer in self.layers)

    def read_ahead(self, on: bool) -> None:
        """Switch reading ahead on or off (off: the guesses not yet used are dropped)."""
        self.prefetch = on
        if not on:
            for waiting in self._pending.values():
                for future in waiting.values():
                    future.cancel()
            self._pending.clear()

    def add_layer(
        self,
        glu: Any,
        num_experts: int,
        slots: int,
        sources: dict[str, ExpertSource],
        choose: Callable[[mx.array], mx.array] | None = None,
    ) -> ExpertLayer:
        layer = ExpertLayer(self, len(self.layers), glu, num_experts, slots, sources, choose)
        self.layers.append(layer)
        return layer

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Fill every slab with its layer's first experts, so the resident share is held
        (and counted) from the start; routing then decides which stay. ``progress(done,
        total)`` after each layer (it may raise to cancel); reads go ``WARM_BATCH`` experts
        at a time, so the buffers in flight stay small beside the slab."""
        for i, layer in enumerate(self.layers):
            for start in range(0, layer.slots, WARM_BATCH):
                layer.load(list(range(start, min(layer.slots, start + WARM_BATCH))))
            if progress is not None:
                progress(i + 1, len(self.layers))
        self.stats.read_bytes = 0

    def next_choice(self, layer: ExpertLayer, x: mx.array) -> mx.array | None:
        """The next layer's router's choice for ``x`` (lazy), when reading ahead and the pass
        is short enough for a guess to pay."""
        nxt = self.layers[layer.index + 1] if layer.index + 1 < len(self.layers) else None
        if not self.prefetch or nxt is None or nxt.choose is None:
            return None
        if x.size // x.shape[-1] > ROUTER_GUESS_TOKENS:
            return None
        return nxt.choose(x)

    def routed(self, layer: ExpertLayer, ids: np.ndarray, foreseen: np.ndarray | None = None) -> None:
        """A router chose ``ids`` in ``layer``: count them and read the next layers' likely
        experts (``foreseen``: what the next layer's router picks for this layer's input)."""
        layer.frequency *= FREQUENCY_DECAY
        layer.frequency += np.bincount(ids.reshape(-1), minlength=layer.num_experts)
        self._score(layer, ids)
        if foreseen is not None and layer.index + 1 < len(self.layers):
            # Only guesses outside the slab cost a read, so only they are scored: a router
            # right about the experts the slab holds anyway can still waste every read.
            nxt = self.layers[layer.index + 1]
            nxt.by_router.pending.update(int(e) for e in np.unique(foreseen) if nxt.slot_of[e] < 0)
        if not self.prefetch or self._ahead is None or self._pool is None:
            return
        for ahead in self.layers[layer.index + 1 : layer.index + 1 + PREFETCH_LAYERS]:
            likely = ahead.guesses(self.top_k)
            ahead.by_frequency.pending.update(likely)
            if ahead.by_router.pending and ahead.by_router.trusted:
                guesses, pool = sorted(ahead.by_router.pending), self._pool
            elif ahead.by_frequency.trusted:
                guesses, pool = likely, self._ahead
            else:
                continue
            waiting = self._pending.setdefault(ahead.index, OrderedDict())
            for e in guesses:
                if e in waiting:
                    continue
                if len(waiting) >= MAX_PREFETCHED:  # the oldest guess goes
                    waiting.popitem(last=False)[1].cancel()
                waiting[e] = pool.submit(self._read, ahead, e)

    def _score(self, layer: ExpertLayer, ids: np.ndarray) -> None:
        """Score the guesses made for ``layer`` against what its pass routed."""
        stats = self.stats
        n, hit = layer.by_router.score(ids)
        stats.router_guesses, stats.router_right = stats.router_guesses + n, stats.router_right + hit
        n, hit = layer.by_frequency.score(ids)
        stats.frequency_guesses, stats.frequency_right = stats.frequency_guesses + n, stats.frequency_right + hit

    def forget_guesses(self, layer: ExpertLayer) -> None:
        """Drop what was read ahead for ``layer`` and not used by its pass: guesses live one
        pass, so at most ``PREFETCH_LAYERS`` layers' guesses are held at a time."""
        waiting = self._pending.pop(layer.index, None)
        for future in (waiting or {}).values():
            if not future.cancel():  # already read, or being read: its bytes went for nothing
                future.add_done_callback(self._count_wasted)

    def _count_wasted(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.stats.wasted_bytes += sum(a.nbytes for a in future.result().values())

    def fetch(self, layer: ExpertLayer, experts: Sequence[int]) -> dict[str, np.ndarray]:
        """Each source's bytes for ``experts`` [n, nbytes]: read-ahead ones when ready, the
        rest read now (in parallel)."""
        self.check_files(layer.files)
        waiting = self._pending.get(layer.index, {})
        futures = []
        for e in experts:
            future = waiting.pop(e, None)
            self.stats.read_ahead += future is not None
            if future is None:
                future = (
                    self._pool.submit(self._read, layer, e) if self._pool is not None else _done(self._read(layer, e))
                )
            futures.append(future)
        parts = [f.result() for f in futures]
        for part in parts:
            self.stats.read_bytes += sum(a.nbytes for a in part.values())
        return {name: np.stack([part[name] for part in parts]) for name in layer.sources}

    def _read(self, layer: ExpertLayer, expert: int) -> dict[str, np.ndarray]:
        """One expert's bytes of every source (runs on a reader thread: file I/O only)."""
        out: dict[str, np.ndarray] = {}
        seen: dict[tuple[str, int, int], np.ndarray] = {}
        for name, source in layer.sources.items():
            file, offset = source.offsets[expert]
            key = (file, offset, source.nbytes)
            if key not in seen:  # gate and up of one interleaved tensor share a read
                seen[key] = self._pread(file, offset, source.nbytes)
            out[name] = seen[key]
        return out

    def _pread(self, file: str, offset: int, nbytes: int) -> np.ndarray:
        with self._fd_lock:
            fd = self._fds.get(file)
            if fd is None:
                try:
                    fd = self._fds[file] = os.open(file, os.O_RDONLY)
                except OSError as e:
                    raise ExpertFileChanged(_changed(file, e.strerror or str(e))) from None
        buf = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            try:
                n = _read_into(fd, view[done:], offset + done)
            except OSError as e:
                raise ExpertFileChanged(_changed(file, e.strerror or str(e))) from None
            if n <= 0:
                raise ExpertFileChanged(_changed(file, "it is shorter than when it was loaded"))
            done += n
        return buf

    def check_files(self, files: Sequence[str] | None = None) -> None:
        """Raise ExpertFileChanged when a checkpoint file (of ``files``, else any) is not the
        one loaded. A stat each: cheap beside a read, so it runs before every read."""
        for file in files if files is not None else self._files:
            before = self._files[file]
            now = _identity(file)
            if now != before:
                raise ExpertFileChanged(_changed(file, "it vanished" if now is None else "it was modified"))

    def close(self) -> None:
        """Stop the readers and close the files (the model is being unloaded)."""
        pools, self._pool, self._ahead = (self._pool, self._ahead), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Read at ``offset`` into ``view`` (no copy where the system has preadv)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def _identity(file: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _changed(file: str, how: str) -> str:
    name = os.path.basename(file)
    return f"the model file {name} changed on disk while loaded ({how}); the model was unloaded: load it again"


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
