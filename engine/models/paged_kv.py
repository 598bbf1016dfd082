"""Paged KV: full-attention keys and values held in fixed-size blocks shared between sequences.

The blocks, their storage, sharing and eviction are the pool's (engine/models/kv_blocks.py).
Here: a sequence (``PagedSequence``: one chat's or one request's cache) keeps a block table,
the list of blocks that hold its tokens in order, and one ``PagedKVCache`` per paged layer
reads and writes through it, with ``KVCache``'s interface, so attention runs unchanged.

Attention reads a sequence's keys and values from one contiguous array per layer: MLX has
no paged attention kernel. The first pass of a request gathers the blocks it starts from
(a prefix taken from the pool or kept from the last request) and its new tokens into a
view, in one ``mx.concatenate``; later passes write their new tokens at the end of the
view, as ``KVCache`` does, so a decode step copies no prefix. During a request the view
alone holds the new tokens: they go into blocks only before the blocks are read or
published, and when the request ends (``drop_views``, from the prefix cache's ``record``),
a layer at a time, each layer's view freed once its blocks are written. So a request holds
its keys and values once, as the unpaged cache does, not in a view and in blocks (a 32k
prompt peaked 6.9 GB higher on the H200 that way), and a prefill chunk costs no block
writes; between requests a sequence holds only blocks. A sequence decoding in the batch
hands its keys and values to the batch's rows and takes them back into blocks when it
leaves, keeping the published blocks it starts with: the batch reads those in place,
once for every row that starts with them (``shared_blocks``, ``split_off``, ``extend``). A CUDA gather kernel reading the block table inside attention would avoid the
view altogether.

What pages. Full-attention layers, plain (``KVCache``) or quantized (``QuantizedKVCache``:
its codes, scales and biases go into the blocks, and attention reads the codes as there,
``PagedQuantizedKVCache``). Sliding-window layers (``RotatingKVCache``: small and fixed
already), latent MLA caches (not keys and values per head) and recurrent state (one state,
not per token) keep their own caches beside the paged ones (``paged_prompt_cache``).
Blocks are shared across sequences only for models whose every layer pages, since a
sliding or recurrent layer's state at a block boundary is not in the pool; other models
still page their full-attention layers and reuse their own prefix as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import mlx.core as mx

from engine.errors import EngineError
from engine.models.cache_buffers import buffer_tokens
from engine.models.kv_blocks import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_POOL_BYTES,
    Block,
    BlockPool,
    Parts,
    Segment,
    arrays_of,
    check_block_size,
    gather_pieces,
    map_parts,
    parts_of,
    release_all,
)
from engine.models.kv_cache import KVCache, _mask_for, register_cache_kind
from engine.models.quantized_kv_cache import READS_CODES, QuantizedKVCache

# A request's contiguous view grows this many tokens at a time (KVCache's step).
VIEW_STEP = 256


class CannotPage(EngineError):
    """This model's KV cache cannot page; ``reason`` says why without the command line's advice."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; leave out --paged-kv.")
        self.reason = reason


class PagedSequence:
    """One sequence's block table and the offset of each of its paged layers."""

    def __init__(self, pool: BlockPool, shareable: bool) -> None:
        self.pool = pool
        self.table: list[Block] = []
        self.offsets = [0] * pool.layers
        # Per layer during a request: (keys, values) buffers holding the first tokens of
        # the sequence contiguously (capacity past the offset), or None.
        self.views: list[tuple[Parts, Parts] | None] = [None] * pool.layers
        # Per layer: the tokens written into blocks. While a view exists, tokens go into it
        # alone, and into the blocks (``flush_layer``) only before the blocks are read,
        # published or the view dropped: a pass then writes one place, as ``KVCache`` does.
        self.flushed = [0] * pool.layers
        # Per layer, for a quantized layer during a request: the QuantizedKVCache over its view
        # (dropped with the views, so it keeps no view's buffers alive between requests).
        self.view_caches: list[Any] = [None] * pool.layers
        self.shareable = shareable  # every layer of the model pages (blocks hold the whole prefix)
        # The table's blocks go back to the pool whenever this sequence is dropped.
        self._finalizer = weakref.finalize(self, release_all, pool, self.table)

    def writable(self, index: int) -> Block:
        """The block at ``index`` of the table, private to this sequence (copied when
        published or shared), allocated when the table ends there."""
        if index == len(self.table):
            self.table.append(self.pool.allocate())
        block = self.table[index]
        if block.private:
            return block
        fresh = self.pool.allocate()
        # Segments never change: the copy shares the published block's pieces until each
        # layer stores its own.
        fresh.keys, fresh.values = list(block.keys), list(block.values)
        self.pool.release(block)
        self.table[index] = fresh
        return fresh

    def _writable_run(self, n: int, checked: list[int] | None = None) -> list[Block]:
        """The table's first ``n`` blocks, each private (``writable``), checked in one pass.
        ``checked`` (one flush's count of leading blocks already seen private, updated): every
        layer of a request's end asks for the same run, and during a flush blocks only become
        private, so each block is checked once, not once a layer (36 layers of a 32k request
        spent 5 ms checking)."""
        start = checked[0] if checked else 0
        if len(self.table) < n or not all(b.private for b in self.table[start:n]):
            for i in range(n):
                self.writable(i)
        if checked is not None:
            checked[0] = max(start, n)
        return self.table[:n]

    def write(self, layer: int, keys: Parts, values: Parts, start: int) -> list[mx.array]:
        """Put ``layer``'s keys and values for positions ``start``.. (``start`` at a block's
        beginning) into blocks: the whole blocks as one segment, a partial last block as
        another; the arrays written (lazy)."""
        size, n = self.pool.block_size, parts_of(keys)[0].shape[2]
        assert start % size == 0, "a store starts at a block's beginning"
        first, whole = start // size, n // size
        runs = [(first, whole, 0)] if whole else []
        if n % size:
            runs.append((first + whole, 1, whole * size))
        written: list[mx.array] = []
        for index, count, at in runs:
            k, v = (Segment(map_parts(lambda a: _cut(a, at, count * size), x), count) for x in (keys, values))
            written += [*parts_of(k.parts), *parts_of(v.parts)]
            for i in range(count):
                block = self.writable(index + i)
                block.keys[layer], block.values[layer] = (k, i), (v, i)
        return written

    def flush_layer(self, layer: int, adopt: bool = False, checked: list[int] | None = None) -> list[mx.array]:
        """Write ``layer``'s tokens that are only in its view into blocks, from the start of
        the block holding the first of them (the view holds every token); the arrays
        written (lazy). With ``adopt`` (the view is dropped next and never written again), a
        view holding only new tokens becomes the blocks' segment itself, with no copy."""
        start, end, view = self.flushed[layer], self.offsets[layer], self.views[layer]
        self.flushed[layer] = end
        if end <= start or view is None:
            return []
        size = self.pool.block_size
        blocks = -(-end // size)
        if adopt and start == 0 and parts_of(view[0])[0].shape[2] >= blocks * size:
            keys, values = Segment(view[0], blocks), Segment(view[1], blocks)
            for i, block in enumerate(self._writable_run(blocks, checked)):
                block.keys[layer], block.values[layer] = (keys, i), (values, i)
            return []
        start -= start % size
        return self.write(layer, *(map_parts(lambda a: a[..., start:end, :], x) for x in view), start)

    def flush(self, drop: bool = False) -> None:
        """Write every layer's new tokens into blocks, evaluated a layer at a time (a block
        written from a view must not keep the view's buffer alive through its lazy graph);
        with ``drop``, each layer's view is forgotten once written, so no more than one
        layer is held twice at a time, and a view of new tokens alone is adopted whole: a
        fresh 32k request's end then copies nothing (its room past the last token, at most
        ``VIEW_STEP`` tokens, stays with the blocks)."""
        checked = [0]
        for layer in range(len(self.views)):
            written = self.flush_layer(layer, adopt=drop, checked=checked)
            if written:
                mx.eval(written)
            if drop:
                self.views[layer] = self.view_caches[layer] = None

    def drop_views(self) -> None:
        """Forget the contiguous views, once the blocks hold everything."""
        self.flush(drop=True)

    def shrink(self) -> None:
        """Give back the blocks past the furthest layer's offset (after a trim)."""
        size = self.pool.block_size
        need = (max(self.offsets) + size - 1) // size
        while len(self.table) > need:
            self.pool.release(self.table.pop())

    def _digests(self, keys: Sequence[Hashable], signature: str, blocks: int):
        size, previous = self.pool.block_size, b""
        for i in range(blocks):
            previous = self.pool.chain(previous, signature, keys[i * size : (i + 1) * size])
            yield i, previous

    def attach(self, keys: Sequence[Hashable], signature: str, limit: int) -> int:
        """On an empty sequence: take the published blocks that hold the longest prefix of
        ``keys`` in whole blocks of at most ``limit`` tokens; return the tokens taken."""
        if not self.shareable or self.table or max(self.offsets):
            return 0
        for _, digest in self._digests(keys, signature, limit // self.pool.block_size):
            block = self.pool.find(digest)
            if block is None:
                break
            self.table.append(self.pool.take(block))
        held = len(self.table) * self.pool.block_size
        self.offsets = [held] * self.pool.layers
        self.flushed = [held] * self.pool.layers
        return held

    def borrow(self, other: PagedSequence, blocks: int) -> int:
        """On an empty sequence: hold ``other``'s first ``blocks`` blocks by reference (a batch
        row whose prompt starts as ``other``'s, which has just prefilled it); the tokens taken."""
        assert not self.table and not max(self.offsets) and other.pool is self.pool
        assert min(other.flushed) >= blocks * self.pool.block_size, "the lender's blocks hold its prompt"
        self.table.extend(self.pool.take(block) for block in other.table[:blocks])
        held = len(self.table) * self.pool.block_size
        self.offsets = [held] * self.pool.layers
        self.flushed = [held] * self.pool.layers
        return held

    def available(self, keys: Sequence[Hashable], signature: str, limit: int) -> int:
        """How many tokens ``attach`` would take, without taking them."""
        if not self.shareable:
            return 0
        found = 0
        for _, digest in self._digests(keys, signature, limit // self.pool.block_size):
            if self.pool.find(digest) is None:
                break
            found += 1
        return found * self.pool.block_size

    def publish(self, keys: Sequence[Hashable], signature: str) -> None:
        """Publish the table's full blocks, ``keys`` being the tokens the sequence holds."""
        if not self.shareable:
            return
        self.flush()  # what others will read must be in the blocks
        full = min(min(self.offsets), len(keys)) // self.pool.block_size
        for i, digest in self._digests(keys, signature, full):
            block = self.table[i]
            if block.digest == digest:
                continue
            if block.digest is not None:  # published under other keys: these differ
                self.table[i] = block = self.writable(i)
            self.table[i] = self.pool.publish(block, digest)


@register_cache_kind
class PagedKVCache:
    """One paged layer of a sequence, with ``KVCache``'s interface, so attention runs
    unchanged. Saved and copied as a plain ``KVCache`` (``from_meta``)."""

    def __init__(self, sequence: PagedSequence, layer: int) -> None:
        self.sequence = sequence
        self.layer = layer

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> KVCache:
        return KVCache()

    @property
    def offset(self) -> int:
        return self.sequence.offsets[self.layer]

    @offset.setter
    def offset(self, value: int) -> None:
        self.sequence.offsets[self.layer] = value

    size = offset

    def empty(self) -> bool:
        return self.offset == 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != 1:
            raise EngineError("A paged KV cache holds one sequence; batched decoding does not page.")
        seq, start = self.sequence, self.offset
        view = seq.views[self.layer]
        if view is not None and view[0].shape[2] < start:  # a view short of the prefix: start over from blocks
            seq.flush_layer(self.layer)
            view = None
        self.offset = end = start + keys.shape[2]
        if view is None:  # the request's first pass: the blocks hold the prefix
            view = tuple(self._first_view(held, new, start) for held, new in ((0, keys), (1, values)))
        elif view[0].shape[2] < end:  # grow in steps, as KVCache does: one copy
            room = _room(end)
            view = tuple(_grown(a[..., :start, :], new, room) for a, new in zip(view, (keys, values)))
        else:
            view[0][..., start:end, :] = keys
            view[1][..., start:end, :] = values
        seq.views[self.layer] = view
        return view[0][..., :end, :], view[1][..., :end, :]

    def _first_view(self, which: int, new: mx.array, start: int) -> mx.array:
        """The blocks' keys (``which`` 0) or values (1) of positions [0, start), ``new``
        after them, and room to grow, in one copy."""
        held: list[mx.array] = self._pieces(which, start)  # type: ignore[assignment]
        if held and (past := sum(a.shape[2] for a in held) - start):
            held[-1] = held[-1][..., : held[-1].shape[2] - past, :]
        return _grown(held, new, _room(start + new.shape[2]))

    def _pieces(self, which: int, end: int, first: int = 0) -> list[Parts]:
        """This layer's keys (``which`` 0) or values (1) of the blocks holding positions
        [first block's start, end), a run of one segment as one slice."""
        size = self.sequence.pool.block_size
        blocks = self.sequence.table[first : (end + size - 1) // size]
        return gather_pieces([(b.keys if which == 0 else b.values)[self.layer] for b in blocks], size)  # type: ignore[misc]

    def pending_arrays(self) -> list[mx.array]:
        """The arrays a pass wrote into: this layer's view and blocks (evaluated after a
        prefill chunk instead of ``state``, which would gather a copy of them all)."""
        view = arrays_of(self.sequence.views[self.layer] or ())
        segments = {
            id(p[0]): p[0] for b in self.sequence.table for p in (b.keys[self.layer], b.values[self.layer]) if p
        }
        return [*view, *arrays_of([s.parts for s in segments.values()])]

    def held(self) -> tuple[Parts, Parts]:
        """The sequence's keys and values of this layer, gathered from its blocks."""
        self.sequence.flush_layer(self.layer)
        end = self.offset
        return _joined(self._pieces(0, end), end), _joined(self._pieces(1, end), end)

    def make_mask(self, n_queries: int, window: int | None = None):
        return _mask_for(self.offset, self.offset + n_queries, n_queries, window)

    # -- a batch holding a shared prefix once (engine/decode/batch_cache.py) ----------

    def leading(self, end: int) -> tuple[Parts, Parts]:
        """Keys and values of positions [0, end) as the blocks hold them: a slice of one
        segment, no copy, when they are one run of it."""
        return _joined(self._pieces(0, end), end), _joined(self._pieces(1, end), end)

    def split_off(self, start: int) -> tuple[mx.array, mx.array] | tuple[()]:
        """Keep positions [0, start) (whole blocks) and hand over the rest, gathered: the
        batch holds them until ``extend`` gives them back."""
        seq, layer = self.sequence, self.layer
        seq.flush_layer(layer)
        end = self.offset
        size = seq.pool.block_size
        assert start % size == 0 and start <= end
        rest: tuple[mx.array, mx.array] | tuple[()] = ()
        if end > start:
            rest = tuple(_joined(self._pieces(w, end, start // size), end - start) for w in (0, 1))  # type: ignore[assignment]
        seq.views[layer] = seq.view_caches[layer] = None
        self.offset = start
        seq.flushed[layer] = min(seq.flushed[layer], start)
        seq.shrink()
        return rest

    def extend(self, keys: mx.array, values: mx.array) -> None:
        """Put ``keys``/``values`` after the tokens held (``split_off``'s boundary) straight
        into blocks."""
        seq, start = self.sequence, self.offset
        seq.write(self.layer, keys, values, start)
        self.offset = seq.flushed[self.layer] = start + keys.shape[2]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        self.sequence.flushed[self.layer] = min(self.sequence.flushed[self.layer], self.offset)
        self.sequence.shrink()
        return n

    @property
    def nbytes(self) -> int:
        """This layer's bytes in blocks only this sequence holds (shared ones are the pool's)."""
        return sum(b.layer_bytes(self.layer) for b in self.sequence.table if b.private)

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        return () if self.offset == 0 else self.held()

    @state.setter
    def state(self, value) -> None:
        self.trim(self.offset)
        if value:
            self.update_and_fetch(*value)

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset)}

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        pass  # the offset follows the state written in


def _room(end: int) -> int:
    """A view's length for ``end`` tokens: whole ``VIEW_STEP``s and the pad that picks the
    decode kernel (cache_buffers.buffer_tokens)."""
    return buffer_tokens(end, VIEW_STEP)


def _grown(held: mx.array | list[mx.array], new: mx.array, length: int) -> mx.array:
    """``held`` (an array or the pieces of one) then ``new`` along the tokens, zero-padded
    to ``length`` tokens, in one concatenation."""
    pieces = [*(held if isinstance(held, list) else [held]), new]
    used = sum(p.shape[2] for p in pieces)
    if length > used:
        pieces.append(mx.zeros((*new.shape[:2], length - used, new.shape[3]), new.dtype))
    return mx.concatenate(pieces, axis=2)


def _joined(pieces: list[Parts], end: int) -> Parts:
    """Consecutive keys (or values) as one array (or triple), cut at ``end`` tokens."""
    if len(pieces) == 1:
        return map_parts(lambda a: a[..., :end, :], pieces[0])
    if isinstance(pieces[0], tuple):
        return tuple(mx.concatenate(parts, axis=2)[..., :end, :] for parts in zip(*pieces))
    return mx.concatenate(pieces, axis=2)[..., :end, :]  # type: ignore[arg-type]


def _cut(a: mx.array, at: int, length: int) -> mx.array:
    """``length`` tokens of ``a`` from ``at``, zero-padded past its end, in an array of its
    own (a slice of a view would keep the whole view's buffer)."""
    piece = a[..., at : at + length, :]
    short = length - piece.shape[2]
    if short:
        return mx.concatenate([piece, mx.zeros((*a.shape[:2], short, a.shape[3]), a.dtype)], axis=2)
    return mx.contiguous(piece)


_LAYOUT = ("groups", "packed")


@register_cache_kind
class PagedQuantizedKVCache(PagedKVCache):
    """A paged layer stored quantized: the blocks hold ``QuantizedKVCache``'s codes, scales
    and biases, and during a request a ``QuantizedKVCache`` over the contiguous view quantizes
    the new tokens and attends over the codes as it does unpaged. Saved as that cache."""

    def __init__(self, sequence: PagedSequence, layer: int, bits: int, group_size: int) -> None:
        super().__init__(sequence, layer)
        self.bits, self.group_size = bits, group_size

    @property
    def inner(self) -> QuantizedKVCache | None:
        """The view's cache, while the request runs."""
        return self.sequence.view_caches[self.layer]

    @inner.setter
    def inner(self, cache: QuantizedKVCache | None) -> None:
        self.sequence.view_caches[self.layer] = cache

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> QuantizedKVCache:  # type: ignore[override]
        return QuantizedKVCache.from_meta(meta)

    def _view(self) -> QuantizedKVCache:
        """The quantized cache over this layer's view: gathered from the blocks when the
        request's views were dropped (or never made)."""
        if self.inner is None or self.sequence.views[self.layer] is None:
            inner = QuantizedKVCache(self.bits, self.group_size)
            if self.offset:
                keys, values = self.held()
                inner.state = (*parts_of(keys), *parts_of(values))
                inner.meta_state = self.meta_state
            self.inner = inner
        return self.inner

    def _stored(self) -> None:
        """After the view's cache took new tokens: the offset and the view."""
        inner, seq = self.inner, self.sequence
        assert inner is not None and inner.keys is not None and inner.values is not None
        if self.layer not in seq.pool.layouts:  # fixed by the shapes: learnt from the first tokens
            seq.pool.layouts[self.layer] = {k: v for k, v in inner.meta_state.items() if k in _LAYOUT}
        self.offset = inner.offset
        seq.views[self.layer] = (inner.keys, inner.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != 1:
            raise EngineError("A paged KV cache holds one sequence; batched decoding does not page.")
        out = self._view().update_and_fetch(keys, values)
        self._stored()
        return out

    def store(self, keys: mx.array, values: mx.array) -> None:
        self._view().store(keys, values)
        self._stored()

    @property
    def reads_codes(self) -> bool:
        return READS_CODES

    def attends_quantized(self, keys: mx.array, values: mx.array) -> bool:
        return self._view().attends_quantized(keys, values)

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        return self._view().attend(queries, scale, mask)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.inner is not None:
            self.inner.offset = self.offset
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:  # type: ignore[override]
        if self.offset == 0:
            return ()
        keys, values = self.held()
        return (*parts_of(keys), *parts_of(values))

    @state.setter
    def state(self, value) -> None:
        self.trim(self.offset)
        self.inner = None
        if value:
            value = tuple(value)
            n = value[0].shape[2]
            self.sequence.write(self.layer, value[:3], value[3:], 0)
            self.offset = n
            self.sequence.flushed[self.layer] = n

    @property
    def meta_state(self) -> dict[str, str]:
        return {
            **QuantizedKVCache(self.bits, self.group_size).meta_state,
            **self.sequence.pool.layouts.get(self.layer, {}),
            "offset": str(self.offset),
        }

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        self.sequence.pool.layouts[self.layer] = {k: v for k, v in value.items() if k in _LAYOUT}


def paged_prompt_cache(cache: list, pool: BlockPool) -> list:
    """``cache`` (one per layer, as the model makes it) with its full-attention layers,
    plain or quantized, paged in ``pool``; the other kinds stay as they are (see the
    module's docstring)."""
    paged = [i for i, c in enumerate(cache) if type(c) in (KVCache, QuantizedKVCache)]
    if len(paged) != pool.layers:
        raise EngineError(f"The KV block pool was made for {pool.layers} paged layers, this model has {len(paged)}.")
    sequence = PagedSequence(pool, shareable=len(paged) == len(cache))
    out = list(cache)
    for slot, i in enumerate(paged):
        c = cache[i]
        out[i] = (
            PagedKVCache(sequence, slot)
            if type(c) is KVCache
            else PagedQuantizedKVCache(sequence, slot, c.bits, c.group_size)
        )
    return out


class ModelPool(BlockPool):
    """A model's block pool as ``make_prompt_cache`` uses it (``model.kv_pool``): it pages
    the caches the model makes."""

    def page(self, cache: list) -> list:
        return paged_prompt_cache(cache, self)


def _plain_shareable(cache: Sequence[Any]) -> PagedSequence | None:
    """The sequence behind a prompt cache whose every layer pages plainly (no quantized or
    other kind beside them), so its blocks hold the whole prefix; None otherwise."""
    sequence = sequence_of(cache)
    if sequence is None or not sequence.shareable or any(type(c) is not PagedKVCache for c in cache):
        return None
    return sequence


def shared_blocks(cache: Sequence[Any]) -> tuple[tuple[Block, ...], int]:
    """The published or shared blocks a plain paged prompt cache starts with (never written
    again: copy on write), as far as every layer holds them, and their tokens: the part of
    its prefix other sequences may be reading too."""
    sequence = _plain_shareable(cache)
    if sequence is None:
        return (), 0
    size = sequence.pool.block_size
    run: list[Block] = []
    for block in sequence.table[: min(sequence.offsets) // size]:
        if block.private:
            break
        run.append(block)
    return tuple(run), len(run) * size


def fresh_block_size(cache: Sequence[Any]) -> int:
    """The block size of an empty plain paged prompt cache whose blocks can be shared (a
    batch row that may borrow another's prompt blocks, ``PagedSequence.borrow``), else 0."""
    sequence = _plain_shareable(cache)
    if sequence is None or sequence.table or max(sequence.offsets):
        return 0
    return sequence.pool.block_size


def sequence_of(cache: Sequence[Any] | None) -> PagedSequence | None:
    """The paged sequence behind a prompt cache, or None for an unpaged one."""
    for c in cache or ():
        if isinstance(c, PagedKVCache):
            return c.sequence
    return None


def pool_for(model: Any, block_size: int = DEFAULT_BLOCK_SIZE, budget_bytes: int | None = None) -> ModelPool:
    """Give ``model`` a block pool (``make_prompt_cache`` then pages its caches)."""
    if not hasattr(model, "make_cache") and not hasattr(model, "layers"):
        raise CannotPage("This model keeps no KV cache (it embeds text, it does not generate)")
    if getattr(model, "cannot_page", ""):  # a family that says why its caches cannot page
        raise CannotPage(model.cannot_page)
    base = list(model.make_cache()) if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    layers = sum(1 for c in base if type(c) is KVCache)
    if layers == 0:
        raise CannotPage("This model has no full-attention KV cache to page")
    if any(getattr(m, "length_dependent", False) for _, m in model.named_modules()):
        # Shared blocks would hold keys rotated for another request's pass length: not the
        # keys transformers computes for this request.
        raise CannotPage(
            "This model's RoPE scaling (dynamic or LongRoPE) rotates each position by the length of "
            "the pass, so blocks computed by another request would not be exact"
        )
    # Blocks of one precision are never read as another's: the KV settings are part of every digest.
    precision = getattr(getattr(model, "kv_quantization", None), "settings", None)
    identity = (
        f"{type(model).__module__}.{type(model).__name__}:{getattr(model, 'model_path', '')}:{id(model)}:{precision}"
    )
    pool = ModelPool(layers, check_block_size(block_size), identity, budget_bytes or DEFAULT_POOL_BYTES)
    model.kv_pool = pool
    return pool
