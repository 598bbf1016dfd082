"""The per-rank memory plan of a sharded load, made before any weight is read.

Sizes come from the safetensors headers (names, dtypes, shapes only): each decoder
layer's bytes, the embedding's, and the head's with the final norm. Each rank says how
much room it has (its memory budget); the plan then

- pipeline: cuts the layers into contiguous ranges sized by each rank's room after what
  it holds besides layers (the embedding on the first rank, the head on the last), so a
  machine with twice the memory takes about twice the layers, and every rank gets one;
- tensor: gives every rank 1/N of each layer plus a copy of embedding and head.

A split where some rank's share does not fit its room is refused in one line naming
the rank, its host, what it needs and what it has. Mlx-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import OutOfMemoryBudget

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Room kept per rank for activations and the first tokens' cache, beyond the weights.
WORKSPACE_BYTES = 64 << 20


@dataclass
class Sizes:
    """What the checkpoint holds, by role."""

    layers: list[int]  # bytes of each decoder layer
    embed: int
    head: int  # the head and the final norm (0 extra when tied to the embedding)
    tied: bool
    # What a family's sanitize tells from weights a rank may not hold: whether the
    # checkpoint is in the Hub's layout (conv kernels last, as Qwen3.5's are there).
    hub_layout: bool = False


@dataclass
class RankShare:
    rank: int
    host: str
    start: int  # first layer (pipeline); 0 for tensor
    end: int  # one past the last layer (pipeline); all layers for tensor
    need: int
    room: int

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "start": self.start,
            "end": self.end,
            "need": self.need,
            "room": self.room,
        }


def checkpoint_sizes(folder: Path, n_layers: int, tied: bool) -> Sizes:
    """Bytes by role from the files' headers (rank 0 reads them; no tensor data is read)."""
    from engine.artifacts.weights import find_weights, read_headers, weights_bytes

    headers = read_headers(find_weights(folder))
    layers = [0] * n_layers
    embed = head = 0
    hub = any(n.endswith("conv1d.weight") and info.shape[-1] != 1 for n, info in headers.items())
    for name, info in headers.items():
        size = weights_bytes({name: info}, None)
        m = LAYER_NAME.search(name)
        if m is not None:
            i = int(m.group(1))
            if i < n_layers:  # beyond: built-in MTP layers, not loaded sharded
                layers[i] += size
        elif "embed_tokens" in name or name.endswith("wte.weight"):
            embed += size
        elif "lm_head" in name or name.endswith(("norm.weight", "norm.bias")):
            head += size
    return Sizes(layers, embed, head, tied, hub)


def _extras(sizes: Sizes, rank: int, n: int) -> int:
    extra = WORKSPACE_BYTES
    if rank == 0:
        extra += sizes.embed
    if rank == n - 1:
        extra += sizes.head + (sizes.embed if sizes.tied and n > 1 else 0)
    return extra


def _refuse(share: RankShare, how: str) -> OutOfMemoryBudget:
    gb = 1e9
    return OutOfMemoryBudget(
        f"rank {share.rank} on {share.host} needs {share.need / gb:.2f} GB for its {how} "
        f"but has room for {share.room / gb:.2f} GB: add a machine, free memory there, or use a smaller quantization"
    )


def plan_pipeline(sizes: Sizes, rooms: list[int], hosts: list[str]) -> list[RankShare]:
    """Contiguous layer ranges sized by each rank's room; refused when a share cannot fit."""
    n, total_layers = len(rooms), len(sizes.layers)
    if n > total_layers:
        raise OutOfMemoryBudget(f"{n} machines for {total_layers} layers: use at most {total_layers} machines")
    free = [max(0, rooms[r] - _extras(sizes, r, n)) for r in range(n)]
    weight = sum(free) or n
    total = sum(sizes.layers)
    cuts, acc, start = [], 0.0, 0
    for r in range(n - 1):
        acc += (free[r] if sum(free) else 1) / weight * total
        end, running = start, sum(sizes.layers[:start])
        # Take layers while their running total stays nearest the rank's proportional mark.
        while end < total_layers - (n - 1 - r) and (
            end == start or abs(running + sizes.layers[end] - acc) <= abs(running - acc)
        ):
            running += sizes.layers[end]
            end += 1
        cuts.append(end)
        start = end
    bounds = [0, *cuts, total_layers]
    shares = []
    for r in range(n):
        s, e = bounds[r], bounds[r + 1]
        need = sum(sizes.layers[s:e]) + _extras(sizes, r, n)
        shares.append(RankShare(r, hosts[r], s, e, need, rooms[r]))
    for share in shares:
        if share.need > share.room:
            raise _refuse(share, f"layers {share.start}-{share.end - 1}")
    return shares


def plan_tensor(sizes: Sizes, rooms: list[int], hosts: list[str]) -> list[RankShare]:
    """A 1/N slice of every layer per rank, embedding and head on each; refused when one
    rank's share cannot fit."""
    n = len(rooms)
    each = -(-sum(sizes.layers) // n) + sizes.embed + (0 if sizes.tied else sizes.head) + WORKSPACE_BYTES
    shares = [RankShare(r, hosts[r], 0, len(sizes.layers), each, rooms[r]) for r in range(n)]
    for share in shares:
        if share.need > share.room:
            raise _refuse(share, f"1/{n} of every layer")
    return shares
