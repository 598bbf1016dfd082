"""KV caches that survive restarts: a chat session's cache saved to a file and used again.

A file holds the cache of every layer (models.kv_cache's format) and, in its metadata,
what the cache is only valid for: the model (its folder and a fingerprint of its weight
files), the active adapters, the chat template, and the token ids it holds. A file whose
identity differs from what is loaded now is not used; a damaged or truncated file is
skipped (the prompt is prefilled as if there were none) and replaced by the next save. So
a saved cache can make a turn faster, never different.

Before reading, the engine weighs reading the file against prefilling its tokens again
(runtime/reopen_choice.py) and takes the faster; the choice is kept on the chat
(``reopen_choice``) for ``generate --json`` and the bench to report.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.models.kv_cache import load_prompt_cache, save_prompt_cache
from engine.models.lora import active_signature

IDENTITY_KEYS = ("model", "weights", "adapters", "template", "kv")
_EDGE = 1 << 16  # bytes read from each end of a weight file for its fingerprint


def weights_fingerprint(path: str | Path) -> str:
    """A digest of a model's weight files that changes when any of them does: each file's
    name, size, and first and last 64 KiB (the safetensors header, with every tensor's
    offsets and dtype, is in the first). Reads a few hundred KB, not the weights."""
    from engine.artifacts.weights import find_weights

    path = Path(path)
    files = [path] if path.is_file() else find_weights(path)
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as handle:
            digest.update(handle.read(_EDGE))
            if size > 2 * _EDGE:
                handle.seek(size - _EDGE)
                digest.update(handle.read(_EDGE))
    return digest.hexdigest()


def template_fingerprint(template: Any) -> str:
    source = getattr(template, "source", None) or type(template).__name__
    return hashlib.sha256(str(source).encode()).hexdigest()


def session_identity(model_path: str, weights: str, model: Any, template: Any, kv: str = "") -> dict[str, str]:
    """What a saved cache of ``model`` is valid for (``weights``: ``weights_fingerprint``)."""
    return {
        "model": str(Path(model_path).resolve()),
        "weights": weights,
        "adapters": active_signature(model),
        "template": template_fingerprint(template),
        "kv": kv,
    }


def save_session(path: str | Path, chat: Any, identity: dict[str, str]) -> int:
    """Write ``chat``'s cache with its identity and token ids; returns the file's size in
    bytes (0 when there is nothing worth saving: an empty cache, or media tokens, whose
    keys are content hashes a file cannot check)."""
    cache = chat.cache
    if not cache or not chat.ids or list(chat.token_keys) != list(chat.ids):
        return 0
    metadata = {**identity, "token_ids": json.dumps(chat.ids)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_prompt_cache(path, cache, metadata)
    return path.stat().st_size


def restore_session(path: str | Path, chat: Any, identity: dict[str, str], choose: bool = True) -> tuple[int, str]:
    """Put the cache saved in ``path`` into ``chat`` when it was made under ``identity``
    and reading it is faster than prefilling its tokens again (``choose``; runtime/
    reopen_choice.py). Returns (tokens restored, why nothing was when 0). The session's
    own prefix reuse then keeps what the next prompt shares with the saved ids, and
    prefills only the rest."""
    path = Path(path)
    if not path.is_file():
        return 0, "no saved cache"
    if choose:
        from engine.runtime.reopen_choice import choose_for

        choice = chat.reopen_choice = choose_for(path, chat.model)
        if choice.path == "recompute":
            return 0, (
                f"prefilling the {choice.tokens:,} tokens again (~{choice.recompute_s:.2f} s) is faster "
                f"than reading the saved cache (~{choice.read_s:.2f} s)"
            )
    try:
        cache, metadata = load_prompt_cache(path)
        ids = [int(i) for i in json.loads(metadata["token_ids"])]
    except (EngineError, KeyError, ValueError, TypeError) as exc:
        return 0, f"the saved cache is unreadable ({' '.join(str(exc).split())[:200]})"
    for key in IDENTITY_KEYS:
        if metadata.get(key, "") != identity.get(key, ""):
            return 0, f"the saved cache was made with another {key}"
    if not cache or int(cache[0].offset) != len(ids):
        return 0, "the saved cache does not match its token ids"
    chat.reset()
    chat.cache, chat.ids, chat.token_keys = cache, list(ids), list(ids)
    chat.signature = identity["adapters"]
    return len(ids), ""
