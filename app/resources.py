"""Where the app's icons, style sheets, presets and recommended models live.

The project keeps them in ``resources/`` at the top of the source tree. A source checkout
(and an editable install) finds them there; an installed wheel carries them as data files
under ``share/mlx-desk/resources`` of its prefix, found through the distribution's file
list; a PyInstaller bundle unpacks them to ``resources/`` under ``sys._MEIPASS``.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[1] / "resources"
_MARKER = "style.qss"  # a file every copy of the folder has


def _installed() -> Path | None:
    from importlib import metadata

    try:
        files = metadata.files("mlx-desk") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == _MARKER and f.parent.name == "resources":
            return Path(str(f.locate())).resolve().parent
    return None


@lru_cache(maxsize=1)
def _located() -> Path:
    if (_SOURCE / _MARKER).is_file():
        return _SOURCE
    return _installed() or _SOURCE


def resource_dir() -> Path:
    base = getattr(sys, "_MEIPASS", None)
    if base and (Path(base) / "resources").is_dir():
        return Path(base) / "resources"
    return _located()


def resource_path(name: str) -> Path:
    return resource_dir() / name
