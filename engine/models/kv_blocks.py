"""The block pool of paged KV (engine/models/paged_kv.py): blocks, their storage, sharing and eviction.

A ``BlockPool`` (one per loaded model) owns every block. A block holds ``block_size``
tokens of keys and values for each paged layer of the model, as *pieces* of segments: a
``Segment`` is one layer's keys (or values) of consecutive blocks stored together, one
array [1, heads, blocks * block_size, head_dim] written once and never changed. A store
(the end of a request writing its new tokens) makes one segment per layer for its whole
blocks and one for a partial last block, so its cost is a few arrays per layer, not one
per block; a sequence reading back blocks it stored reads one slice per run of a segment.

Sharing. A full block is *published* under a digest of a hash chain: the previous block's
digest, the pool's identity (the model, its KV precision and dtype), the sequence's
signature (the active adapters and their scales) and the block's token keys (a media
token's key names the media's content, so two photos never share a block although their
ids agree). A sequence whose prompt starts with the same keys finds those blocks by the
same chain and takes them by reference (``PagedSequence.attach``): two chats with the same
system prompt, a chat and its regenerate, the app and the server hold it once. Published
blocks never change: a sequence that writes into one (a regenerate trimmed back into the
middle of a block) first copies it (copy on write: its piece references, since segments
never change), so only the first differing block and those after it are new. A block
computed twice (two sequences prefilling the same prompt at once) is folded into the one
published first.

Eviction. Blocks count references from block tables. A block no table holds is freed at
once unless published; published idle blocks stay cached for the next sequence that
shares them and are evicted least recently used first when the pool's bytes pass its
budget. Blocks in use are never evicted. Bytes are counted by block (a segment's bytes
shared among its blocks); a segment's memory returns when its last block goes, so blocks
trimmed out of the middle of a stored run (an edit) free theirs with the rest of the run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.errors import EngineError

# Tokens per block, chosen by measurement on a 2-core CPU (docs/paged-kv.md): 64 decoded as
# fast as 256 at 4k tokens while a regenerate or an unshared tail wastes a quarter as much.
DEFAULT_BLOCK_SIZE = 64
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
# Idle published blocks kept when the host gives no budget.
DEFAULT_POOL_BYTES = 1 << 30


# A layer's keys (or values) in a block or a view: one array [1, heads, tokens, head_dim],
# or for a quantized layer the triple (codes, scales, biases), each with tokens on axis 2.
Parts = mx.array | tuple[mx.array, ...]


def parts_of(x: Parts) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


def map_parts(f: Any, x: Parts) -> Parts:
    return tuple(f(a) for a in x) if isinstance(x, tuple) else f(x)


def arrays_of(layers: Sequence[Parts | None]) -> list[mx.array]:
    return [a for x in layers if x is not None for a in parts_of(x)]


def check_block_size(n: int) -> int:
    if n not in BLOCK_SIZES:
        raise EngineError(f"The paged KV block size must be one of {', '.join(map(str, BLOCK_SIZES))} (got {n}).")
    return n


@dataclass(eq=False)
class Segment:
    """One layer's keys (or values) of ``blocks`` consecutive blocks, written by one store:
    the whole blocks of a flush, or its last, partial block on its own (the next store starts
    at that block and frees it whole). Never written after: blocks hold pieces of it by
    reference (a copy on write copies references), and its memory returns when the last
    block holding a piece goes. One array per layer and flush, not one per block: a 32k
    request's end wrote 37k small arrays on the H200 (0.3 s) where it now writes 72."""

    parts: Parts  # [1, heads, blocks * block_size, head_dim] (or the quantized triple)
    blocks: int

    @property
    def block_bytes(self) -> int:
        return sum(a.nbytes for a in parts_of(self.parts)) // self.blocks


# A block's keys (or values) of one layer: a segment and the block's place in it.
Piece = tuple[Segment, int]


def gather_pieces(pieces: Sequence[Piece], size: int) -> list[Parts]:
    """The arrays of ``pieces`` in order, each run of consecutive pieces of one segment
    sliced once (a request continuing its own blocks reads one slice per layer)."""
    out: list[Parts] = []
    i = 0
    while i < len(pieces):
        segment, first = pieces[i]
        j = i + 1
        while j < len(pieces) and pieces[j][0] is segment and pieces[j][1] == first + j - i:
            j += 1
        lo, hi = first * size, (first + j - i) * size
        out.append(map_parts(lambda a: a[..., lo:hi, :], segment.parts))
        i = j
    return out


@dataclass(eq=False)
class Block:
    """``block_size`` tokens of keys and values, one pair of pieces per paged layer."""

    number: int
    keys: list[Piece | None]
    values: list[Piece | None]
    refs: int = 0
    digest: bytes | None = None  # set once published (then it never changes)

    @property
    def nbytes(self) -> int:
        return sum(p[0].block_bytes for p in (*self.keys, *self.values) if p is not None)

    def layer_bytes(self, layer: int) -> int:
        return sum(p[0].block_bytes for p in (self.keys[layer], self.values[layer]) if p is not None)

    @property
    def private(self) -> bool:
        """Held by one sequence and unpublished: written in place, counted as that sequence's."""
        return self.refs == 1 and self.digest is None


@dataclass
class PoolStats:
    block_size: int
    used: int  # blocks some sequence holds
    shared: int  # blocks more than one sequence holds
    cached: int  # published blocks no sequence holds, kept for reuse
    bytes: int
    budget_bytes: int


@dataclass
class BlockPool:
    """Every block of one model's paged layers (see the module's docstring)."""

    layers: int
    block_size: int = DEFAULT_BLOCK_SIZE
    identity: str = ""  # the model and its KV precision: part of every digest
    budget_bytes: int = DEFAULT_POOL_BYTES
    _next: int = 0
    _held: dict[int, Block] = field(default_factory=dict)  # blocks with references
    _published: dict[bytes, Block] = field(default_factory=dict)
    _idle: OrderedDict[bytes, Block] = field(default_factory=OrderedDict)  # published, unreferenced, oldest first
    # A quantized paged layer's layout (group sizes, head packing), the same for every sequence.
    layouts: dict[int, dict[str, str]] = field(default_factory=dict)

    def allocate(self) -> Block:
        block = Block(self._next, [None] * self.layers, [None] * self.layers, refs=1)
        self._next += 1
        self._held[block.number] = block
        return block

    def take(self, block: Block) -> Block:
        """Add a reference to ``block`` (bringing an idle cached block back into use)."""
        if block.refs == 0 and block.digest is not None:
            self._idle.pop(block.digest, None)
            self._held[block.number] = block
        block.refs += 1
        return block

    def release(self, block: Block) -> None:
        block.refs -= 1
        if block.refs > 0:
            return
        self._held.pop(block.number, None)
        if block.digest is not None and self._published.get(block.digest) is block:
            self._idle[block.digest] = block
            self.evict()

    def find(self, digest: bytes) -> Block | None:
        return self._published.get(digest)

    def publish(self, block: Block, digest: bytes) -> Block:
        """Make a full block findable by ``digest``; the block the sequence should hold
        (the one published earlier under the same digest, if another sequence computed it)."""
        known = self._published.get(digest)
        if known is not None and known is not block:
            self.take(known)
            self.release(block)
            return known
        block.digest = digest
        self._published[digest] = block
        return block

    def chain(self, previous: bytes, signature: str, keys: Sequence[Hashable]) -> bytes:
        """The digest of a block of ``keys`` following the block digested ``previous``."""
        h = hashlib.sha256(previous)
        h.update(f"{self.identity}\x00{signature}\x00{self.block_size}\x00".encode())
        h.update(repr(tuple(keys)).encode())
        return h.digest()

    def evict(self, budget: int | None = None) -> int:
        """Free idle cached blocks, least recently used first, until the pool's bytes fit
        ``budget`` (default its own); return how many were freed."""
        budget = self.budget_bytes if budget is None else budget
        total, freed = self.nbytes, 0
        while self._idle and total > budget:
            digest, block = self._idle.popitem(last=False)
            del self._published[digest]
            total -= block.nbytes
            freed += 1
        return freed

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._held.values()) + sum(b.nbytes for b in self._idle.values())

    @property
    def common_bytes(self) -> int:
        """Bytes in blocks no one sequence counts as its own (``PagedKVCache.nbytes`` counts
        only private blocks): published or shared ones, held or idle. A sequence's caches
        plus this is every KV byte, each counted once."""
        held = sum(b.nbytes for b in self._held.values() if not b.private)
        return held + sum(b.nbytes for b in self._idle.values())

    def stats(self) -> PoolStats:
        used = list(self._held.values())
        return PoolStats(
            block_size=self.block_size,
            used=len(used),
            shared=sum(1 for b in used if b.refs > 1),
            cached=len(self._idle),
            bytes=self.nbytes,
            budget_bytes=self.budget_bytes,
        )


def release_all(pool: BlockPool, table: list[Block]) -> None:
    for block in table:
        pool.release(block)
    table.clear()
