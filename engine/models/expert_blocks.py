"""A pass's (token, expert) pairs laid out in blocks of rows that share one expert, so that
MLX's CUDA expert product reads each expert's weights once per block, not once per pair.

Why. A MoE block sorts a long pass's pairs by expert (prompts, DiffusionGemma's canvas) so
that each expert's weights serve a run of tokens. MLX's Metal kernel uses that order; its
CUDA ``gather_qmm`` does not: it runs every pair as its own one-row product on a tile of
at least 16 rows, reading the pair's whole expert slice each time. DiffusionGemma 26B-A4B's
canvas (256 tokens x 8 of 128 experts) spent 6 ms a layer there on an H200, against about
0.15 ms to read the layer's experts once.

The layout. Sorted by expert, the pairs of expert ``e`` (``count[e]`` of them) take
``ceil(count[e] / rows)`` blocks of ``rows`` rows, the last one padded. The blocks then go
to the expert product as one batch, ``x`` [blocks, rows, dims] with one expert id a block,
each a ``rows``-row matrix product against its expert. The number of blocks is bounded
whatever the routing (``ceil(pairs / rows) + experts``), so the layout is built from array
operations on the device without reading the counts back; blocks past the last filled
one take the last expert (its weights are then in cache) and their rows are ignored, as
are the padding rows (they hold token 0's activations).

When it pays, and how high a block is, were measured on an H200 (4-bit, bf16, one MoE block
of DiffusionGemma 26B-A4B's, Qwen3.5-35B-A3B's and Moonlight's shapes, 64 to 4,096 tokens:
``python -m engine.cli.bench_expert_blocks``). Blocks of 16 rows (MLX's lowest CUDA tile: a
block of fewer rows costs a full tile anyway) were fastest until experts got 64 pairs each
on average, blocks of 64 (its highest) from there; 32 never won. With under 4 pairs an
expert on average most of each block is padding, and pair by pair was as fast or faster.
The same rows of each block are computed whatever else the pass holds, and a pair's output
is one row of a matrix product as before: only the tile it rides in changes, which may
round its float32 sums otherwise (bf16 outputs measured bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.models import quantized_matmul_cuda as qmv
from engine.models.kernel_switches import switch

MIN_ROWS = 16
MAX_ROWS = 64
MIN_AVERAGE = 4  # pairs an expert gets, on average, for the blocks to pay
# ``0`` keeps MLX's one-pair-a-row product on CUDA too (to compare).
ENV = "MLX_DESK_EXPERT_BLOCKS"


def blocks_pay(pairs: int, experts: int) -> bool:
    """Whether a sorted pass of ``pairs`` over ``experts`` takes the blocked layout: on MLX's
    CUDA backend (Metal's kernel already reads a run of sorted pairs' expert once; the CPU's
    runs pair by pair either way), once experts get ``MIN_AVERAGE`` pairs each on average."""
    return enough_pairs(pairs, experts) and switch(ENV, "1") != "0" and qmv.available()


def enough_pairs(pairs: int, experts: int) -> bool:
    """Whether experts get ``MIN_AVERAGE`` pairs each on average, so blocks are not mostly padding."""
    return pairs >= MIN_AVERAGE * experts


def rows_per_block(pairs: int, experts: int) -> int:
    """The block height for ``pairs`` spread over ``experts``: MLX's lowest CUDA tile until
    experts get its highest on average, then its highest (measured: see above)."""
    return MAX_ROWS if pairs >= MAX_ROWS * experts else MIN_ROWS


@dataclass(frozen=True)
class ExpertBlocks:
    """Where each pair sits in the blocked layout, and which expert each block uses."""

    rows: int
    slot_pair: mx.array  # [blocks * rows]: the pair (flat index into ids) filling each slot (0 for padding)
    pair_slot: mx.array  # [pairs]: each pair's slot
    experts: mx.array  # [blocks]: each block's expert id, ascending

    @property
    def blocks(self) -> int:
        return self.experts.shape[0]

    @classmethod
    def of(cls, ids: mx.array, num_experts: int, rows: int | None = None) -> ExpertBlocks:
        """The layout of ``ids`` [..., k] (each pair's expert), in blocks of ``rows`` rows
        (``rows_per_block`` when None)."""
        flat = ids.flatten().astype(mx.int32)
        n = flat.size
        rows = rows or rows_per_block(n, num_experts)
        blocks = -(-n // rows) + num_experts
        order = mx.argsort(flat)
        by_expert = flat[order]
        counts = mx.zeros((num_experts,), dtype=mx.int32).at[by_expert].add(1)
        padded = (counts + rows - 1) // rows * rows
        padded_end = mx.cumsum(padded)
        padded_start = padded_end - padded
        start = mx.cumsum(counts) - counts
        # A sorted pair's slot: its expert's first slot plus its rank among that expert's pairs.
        slot = padded_start[by_expert] + mx.arange(n, dtype=mx.int32) - start[by_expert]
        slot_pair = mx.zeros((blocks * rows,), dtype=mx.int32)
        slot_pair[slot] = order.astype(mx.int32)
        pair_slot = mx.zeros((n,), dtype=mx.int32)
        pair_slot[order] = slot
        # A block's expert: how many experts' slots end at or before its first slot.
        first_slot = mx.arange(blocks, dtype=mx.int32) * rows
        experts = (padded_end[None, :] <= first_slot[:, None]).sum(axis=1).astype(mx.int32)
        return cls(rows, slot_pair, pair_slot, mx.minimum(experts, num_experts - 1))

    def gather(self, x: mx.array, k: int) -> mx.array:
        """Token activations ``x`` [tokens, dims] (each token in ``k`` pairs) as blocks
        [blocks, rows, dims]."""
        return x[self.slot_pair // k].reshape(self.blocks, self.rows, x.shape[-1])

    def scatter(self, y: mx.array) -> mx.array:
        """Blocked outputs [blocks, rows, dims] back to one row a pair, [pairs, dims], in the
        pairs' own order."""
        return y.reshape(-1, y.shape[-1])[self.pair_slot]
