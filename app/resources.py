"""Where the app's icons, style sheets and presets live: ``app/resources/``.

The folder sits inside the ``app`` package, so a source checkout and an installed
wheel (package data) find it beside this file. A PyInstaller bundle unpacks data
under ``sys._MEIPASS``; the spec may put it at ``resources/`` or ``app/resources/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent / "resources"


def resource_dir() -> Path:
    base = getattr(sys, "_MEIPASS", None)
    if base:
        for candidate in (Path(base) / "resources", Path(base) / "app" / "resources"):
            if candidate.is_dir():
                return candidate
    return _HERE


def resource_path(name: str) -> Path:
    return resource_dir() / name
