"""The engine's vocabulary for a model split across machines (part of engine.api).

``PlanShards`` asks the engine whether a model fits across machines with the given
room: the same per-rank plan a sharded load makes (engine.runtime.shard_plan), from the
checkpoint's headers only. ``RankShare`` is one rank of a loaded split as the engine
measured it (``MemoryEvent.ranks``). Mlx-free: the app imports this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHARD_MODES = ("pipeline", "tensor")
SHARD_BACKENDS = ("ring", "jaccl", "nccl", "any")


@dataclass
class PlanShards:
    """Done with a ShardPlan for ``path`` across ``hosts`` (rank order) with ``rooms``
    (each machine's free memory for its share, bytes). Reads file headers only."""

    path: str
    hosts: list[str]
    rooms: list[int]
    shard: str = "pipeline"


@dataclass
class RankShare:
    rank: int
    host: str
    weight_bytes: int  # measured on the rank once loaded; planned need in a ShardPlan
    layers: list[int] = field(default_factory=list)  # [first, end) layers it runs
    room: int = 0


@dataclass
class ShardPlan:
    fits: bool
    ranks: list[RankShare] = field(default_factory=list)
    reason: str = ""  # why it does not fit, in one line (names the rank, its need, its room)
