"""Saved caches of a sharded model: each rank saves and restores its own part.

A rank's part is ``FILE`` with ``.rankR-of-N`` before its suffix, on that rank's machine,
holding the caches of the layers it runs. Its identity (saved_cache.py's: model,
weights, adapters, template, KV settings) also names the split (mode, the rank's layer
range, the number of ranks), so a part written under another split is refused. A
restore counts only when every rank restored the same tokens; otherwise every rank
drops what it restored, and the prompt is prefilled in full, the same on all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def part_path(path: str | Path, spec: Any) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{spec.rank}-of-{spec.size}{path.suffix}")


def split_identity(host: Any, spec: Any) -> dict[str, str]:
    identity = dict(host.session_identity())
    identity["kv"] = f"{identity.get('kv', '')}|{spec.mode} layers {spec.start}-{spec.end} of {spec.size} ranks"
    return identity


def restore(host: Any, spec: Any, session_id: str, path: str, gather_json: Any) -> tuple[int, str]:
    """(tokens restored on every rank, why not when 0); the same answer on all ranks.
    ``gather_json(group, obj)``: every rank's ``obj`` (shard_rank.py's)."""
    from engine.runtime.saved_cache import restore_session

    chat = host.session(session_id)
    if chat.ids:
        tokens, why = 0, "the session already holds a cache"
    else:
        # No read-or-recompute choice: ranks measuring apart could choose apart, and a
        # sharded prefill is every rank's at once.
        tokens, why = restore_session(part_path(path, spec), chat, split_identity(host, spec), choose=False)
    everyone = gather_json(spec.group, [tokens, why])
    counts = {int(t) for t, _ in everyone}
    if len(counts) == 1 and tokens:
        return tokens, ""
    if tokens:
        chat.reset()
    reasons = [f"rank {r}: {w or 'another length'}" for r, (t, w) in enumerate(everyone) if t != max(counts) or w]
    why = "; ".join(reasons) or why
    return 0, why.replace("another kv", "another split or KV setting")


def save(host: Any, spec: Any, session_id: str, path: str) -> int:
    """Bytes this rank wrote for its part."""
    from engine.runtime.saved_cache import save_session

    return save_session(part_path(path, spec), host.session(session_id), split_identity(host, spec))
