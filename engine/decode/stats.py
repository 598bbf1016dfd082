"""The figures a reply accumulates while it is generated.

``StatsCounter`` is written by the decode loop and the speculative verifier on the worker
thread only; what leaves it is ``snapshot()``, a frozen ``api.GenerationStats``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.api import GenerationStats


@dataclass
class StatsCounter:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache
    generated_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    time_to_first_token: float = 0.0  # seconds
    peak_memory_bytes: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.snapshot().acceptance_rate

    def snapshot(self) -> GenerationStats:
        return GenerationStats(**asdict(self))
