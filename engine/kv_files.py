"""A saved-cache folder's files, read without mlx (the app keeps their disk budget with these).

A chat saved by block (engine/runtime/saved_cache.py) is a session file
``<name>.safetensors`` and the block files it names in the folder's ``blocks/``:
``blocks/<digest>.safetensors``, one per whole block of tokens, named by a digest of
everything its keys and values depend on (so a system prompt that starts many chats is one
set of files for all of them). A session names its blocks in order in its header's
metadata (``user.blocks``). This module reads those names from the headers (the first few
KB of each file), counts a folder's bytes with each block once, and removes the blocks no
session names any more.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Iterable
from pathlib import Path

BLOCKS = "blocks"  # the folder of block files, beside the session files
HEADER_LIMIT = 64 << 20  # a safetensors header past this is not one of ours
_DIGEST = re.compile(r"[0-9a-f]{64}")
# A save writes its blocks, then the session file naming them: blocks this recent may be
# a save's under way, so collecting leaves them (a save also touches the blocks it reuses).
GRACE_S = 300.0


def header_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's ``__metadata__`` (empty when the header cannot be read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > HEADER_LIMIT:
                return {}
            meta = json.loads(f.read(length)).get("__metadata__", {})
    except (OSError, ValueError, TypeError, AttributeError, struct.error):
        return {}
    return meta if isinstance(meta, dict) else {}


def named_blocks(metadata: dict[str, str]) -> list[str]:
    """The block digests a session's metadata names, in order (none for a one-file cache)."""
    try:
        names = json.loads(metadata.get("user.blocks", "[]"))
    except ValueError:
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and _DIGEST.fullmatch(n)]


def block_file(folder: str | Path, digest: str) -> Path:
    return Path(folder) / BLOCKS / f"{digest}.safetensors"


def file_size(path: Path) -> int:
    """Its bytes, 0 when it is gone (another thread may remove it)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def session_bytes(session: str | Path) -> int:
    """What reopening ``session`` reads: its file and the blocks it names."""
    session = Path(session)
    blocks = named_blocks(header_metadata(session))
    return file_size(session) + sum(file_size(block_file(session.parent, d)) for d in blocks)


def folder_bytes(folder: str | Path, sessions: Iterable[Path]) -> int:
    """The sessions' files and every block file in ``folder``, each counted once."""
    blocks = Path(folder) / BLOCKS
    files = list(blocks.glob("*.safetensors")) if blocks.is_dir() else []
    return sum(file_size(p) for p in sessions) + sum(file_size(p) for p in files)


def blocks_by_session(sessions: Iterable[Path]) -> dict[Path, list[str]]:
    return {p: named_blocks(header_metadata(p)) for p in sessions}


def collect(folder: str | Path, sessions: Iterable[Path], grace_s: float = GRACE_S, dropped: Iterable[str] = ()) -> int:
    """Remove the block files (and leftovers of cut-short writes) no session in ``sessions``
    names and untouched for ``grace_s``, and at once those in ``dropped`` (named only by
    sessions just removed); return the bytes freed."""
    blocks = Path(folder) / BLOCKS
    if not blocks.is_dir():
        return 0
    named = {d for names in blocks_by_session(sessions).values() for d in names}
    now_gone = set(dropped) - named
    freed, now = 0, time.time()
    for path in blocks.iterdir():
        if path.name.endswith(".safetensors") and path.stem in named:
            continue
        try:
            stat = path.stat()
        except OSError:
            continue
        if now - stat.st_mtime < grace_s and path.stem not in now_gone:
            continue
        size = stat.st_size
        try:
            path.unlink()
        except OSError:
            continue
        freed += size
    return freed
