"""Models offered on first launch, when nothing is on disk yet.

Read from ``recommended_models.json`` in the app's resources when it is there
(``{"default": repo, "models": [{"repo_id", "approx_size_bytes", "why", ...}]}``),
else a short built-in list of small chat models the engine runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.resources import resource_path


@dataclass(frozen=True)
class Recommended:
    repo_id: str
    approx_size_bytes: int
    why: str = ""


BUILT_IN = (
    Recommended("mlx-community/Qwen3-0.6B-4bit", 340_000_000,
                "Smallest good chat model: quick to download, with a thinking mode."),
    Recommended("mlx-community/Llama-3.2-1B-Instruct-4bit", 700_000_000,
                "Meta's small chat model: good English, long context."),
    Recommended("mlx-community/gemma-3-1b-it-4bit", 730_000_000,
                "Google's small Gemma 3 chat model."),
)


def recommended_models() -> list[Recommended]:
    """The list to offer, default first. A missing or unreadable file gives the built-in list."""
    try:
        data = json.loads(resource_path("recommended_models.json").read_text(encoding="utf-8"))
        found = [Recommended(str(m["repo_id"]), int(m.get("approx_size_bytes") or 0),
                             str(m.get("why", ""))) for m in data["models"]]
    except (OSError, ValueError, KeyError, TypeError):
        return list(BUILT_IN)
    default = data.get("default")
    found.sort(key=lambda m: m.repo_id != default)  # stable: the default first, order kept
    return found or list(BUILT_IN)
