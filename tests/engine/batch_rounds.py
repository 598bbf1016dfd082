"""Driving streams through a continuous batch round by round, as the engine worker does:
each round, every stream takes what it has (until it waits), then the batch steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from engine.api import GenerationResult
from engine.decode.loop import WAITING


def drive(
    batch: Any,
    starts: Sequence[int],
    start: Callable[[int], Iterator[Any]],
    *,
    on_round: Callable[[Any], None] | None = None,
    limit: int = 500,
) -> dict[int, GenerationResult]:
    """Stream i (``start(i)``) joins at round ``starts[i]``; rounds go on until every stream
    has ended (at most ``limit``). Each stream's GenerationResult, where it gave one."""
    streams: dict[int, Iterator[Any]] = {}
    results: dict[int, GenerationResult] = {}
    rounds = 0
    while rounds <= max(starts) or streams:
        for i, at in enumerate(starts):
            if at == rounds:
                streams[i] = start(i)
        for i, stream in list(streams.items()):
            for item in stream:
                if item is WAITING:
                    break
                if isinstance(item, GenerationResult):
                    results[i] = item
            else:
                del streams[i]
        batch.step()
        if on_round is not None:
            on_round(batch)
        rounds += 1
        assert rounds < limit
    return results
