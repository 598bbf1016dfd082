"""Where the app's icons, style sheets and presets live (``resources/`` at the top)."""

from __future__ import annotations

import sys
from pathlib import Path


def resource_dir() -> Path:
    # A frozen bundle unpacks data beside the executable; a checkout keeps it at the top.
    base = getattr(sys, "_MEIPASS", None)
    if base:
        return Path(base) / "resources"
    return Path(__file__).resolve().parents[1] / "resources"


def resource_path(name: str) -> Path:
    return resource_dir() / name
