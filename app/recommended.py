"""Models offered on first launch, when nothing is on disk yet.

Read from ``recommended_models.json`` in the app's resources when it is there
(``{"default": repo, "default_by_memory": {"16": repo, ...}, "models": [{"repo_id",
"approx_size_bytes", "min_memory_gb", "why", ...}]}``), else a short built-in list of
small chat models the engine runs. Given the machine's memory, picks that need more are
left out and the default is the one chosen for the largest memory size the machine has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.resources import resource_path

GB = 1024**3  # a Mac's "16 GB" is 16 GiB


@dataclass(frozen=True)
class Recommended:
    repo_id: str
    approx_size_bytes: int
    why: str = ""
    min_memory_bytes: int = 0  # the smallest machine it runs comfortably on


BUILT_IN = (
    Recommended(
        "mlx-community/Qwen3-0.6B-4bit",
        340_000_000,
        "Smallest good chat model: quick to download, with a thinking mode.",
    ),
    Recommended(
        "mlx-community/Llama-3.2-1B-Instruct-4bit", 700_000_000, "Meta's small chat model: good English, long context."
    ),
    Recommended("mlx-community/gemma-3-1b-it-4bit", 730_000_000, "Google's small Gemma 3 chat model."),
)


def recommended_models(memory_bytes: int = 0) -> list[Recommended]:
    """The list to offer, default first; with ``memory_bytes`` (the machine's memory) only
    the picks that fit it, unless none does. A missing or unreadable file gives the
    built-in list."""
    try:
        data = json.loads(resource_path("recommended_models.json").read_text(encoding="utf-8"))
        found = [
            Recommended(
                str(m["repo_id"]),
                int(m.get("approx_size_bytes") or 0),
                str(m.get("why", "")),
                int(float(m.get("min_memory_gb") or 0) * GB),
            )
            for m in data["models"]
        ]
        by_memory = {int(float(k) * GB): str(v) for k, v in (data.get("default_by_memory") or {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return list(BUILT_IN)
    default = data.get("default")
    if memory_bytes:
        # The OS may report a little under the 16 GiB a "16 GB" Mac has: allow 5%.
        fits = [m for m in found if m.min_memory_bytes <= memory_bytes * 1.05]
        found = fits or found
        tiers = [size for size in by_memory if size <= memory_bytes * 1.05]
        if tiers:
            default = by_memory[max(tiers)]
    found.sort(key=lambda m: m.repo_id != default)  # stable: the default first, order kept
    return found or list(BUILT_IN)
