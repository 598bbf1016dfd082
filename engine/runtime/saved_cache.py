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

By block. A cache whose every layer holds keys and values per token (full attention, plain
or quantized, paged or not) is saved as its whole blocks of ``SAVED_BLOCK_TOKENS`` tokens,
each a file named by a digest chain (the identity, the previous block's digest and the
block's token ids) in the folder's ``blocks/`` (engine/kv_files.py), and a session file
holding the rest: the partial last block, the digests in order and the identity. Chats
that start with the same system prompt name the same block files, and a save writes only
the blocks not on disk yet (touching those it reuses), so a prompt shared by many chats is
stored once. Other caches (sliding windows, recurrent state, latent attention) keep one
file. A one-file cache from before still loads; a missing or damaged block is refused as a
damaged file is (the chat prefills in full, and the next save writes it again).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.kv_files import block_file, named_blocks
from engine.models.kv_cache import (
    cache_arrays,
    read_cache_file,
    rebuild_cache,
    user_metadata,
    write_cache_file,
)
from engine.models.lora import active_signature

IDENTITY_KEYS = ("model", "weights", "adapters", "template", "kv")
# Tokens per saved block: large enough that a 16k-token chat is 64 files, small enough that
# a shared system prompt's unshared tail (stored per chat) stays small.
SAVED_BLOCK_TOKENS = 256
# Cache kinds that hold keys and values per token, every array with tokens on axis 2.
_BY_TOKEN = ("KVCache", "QuantizedKVCache", "PagedKVCache", "PagedQuantizedKVCache")
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
    """Write ``chat``'s cache with its identity and token ids; returns the bytes written
    (0 when there is nothing worth saving: an empty cache, or media tokens, whose keys are
    content hashes a file cannot check)."""
    if not chat.cache or not chat.ids or list(chat.token_keys) != list(chat.ids):
        return 0
    return save_cache(path, chat.cache, list(chat.ids), identity)


def save_cache(path: str | Path, cache: list, ids: list[int], identity: dict[str, str]) -> int:
    """Write ``cache``, holding ``ids``, by block where it can (see the module's docstring);
    returns the bytes written (the session file and the blocks not on disk before)."""
    metadata = {**identity, "token_ids": json.dumps(ids)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, header = cache_arrays(cache)
    if not _by_token(header, arrays, len(ids)):
        write_cache_file(path, arrays, header, metadata)  # one file, as save_prompt_cache writes
        return path.stat().st_size
    digests = block_digests(ids, identity)
    written = _save_blocks(path.parent, arrays, header, digests)
    n = len(digests) * SAVED_BLOCK_TOKENS
    tail = {key: a[..., n:, :] for key, a in arrays.items() if a.shape[2] > n}
    metadata.update(blocks=json.dumps(digests), block_tokens=str(SAVED_BLOCK_TOKENS))
    write_cache_file(path, tail, header, metadata)
    return path.stat().st_size + written


def _by_token(header: dict[str, str], arrays: dict[str, Any], tokens: int) -> bool:
    """Whether every layer holds keys and values per token, for all ``tokens``."""
    kinds = [layer["kind"] for layer in json.loads(header["layers"])]
    return all(k in _BY_TOKEN for k in kinds) and all(a.ndim == 4 and a.shape[2] == tokens for a in arrays.values())


def block_digests(ids: list[int], identity: dict[str, str]) -> list[str]:
    """The digest of each whole block of ``ids``: a chain through the identity, the block
    size, the previous digest and the block's ids (what its keys and values depend on)."""
    seed = json.dumps([identity.get(k, "") for k in IDENTITY_KEYS] + [SAVED_BLOCK_TOKENS])
    out, previous = [], hashlib.sha256(seed.encode()).hexdigest()
    for i in range(len(ids) // SAVED_BLOCK_TOKENS):
        block = ids[i * SAVED_BLOCK_TOKENS : (i + 1) * SAVED_BLOCK_TOKENS]
        previous = hashlib.sha256(f"{previous}:{block}".encode()).hexdigest()
        out.append(previous)
    return out


def _save_blocks(folder: Path, arrays: dict[str, Any], header: dict[str, str], digests: list[str]) -> int:
    """Write the blocks not on disk yet (touch the others: recently used); the bytes written."""
    written = 0
    for i, digest in enumerate(digests):
        file = block_file(folder, digest)
        if file.is_file():
            os.utime(file)
            continue
        file.parent.mkdir(parents=True, exist_ok=True)
        lo, hi = i * SAVED_BLOCK_TOKENS, (i + 1) * SAVED_BLOCK_TOKENS
        write_cache_file(file, {key: a[..., lo:hi, :] for key, a in arrays.items()}, header)
        written += file.stat().st_size
    return written


def load_saved(path: str | Path) -> tuple[list, dict[str, str]]:
    """A saved cache and its metadata, its blocks read and joined when saved by block;
    EngineError when the file or a block is missing, damaged or does not fit."""
    import mlx.core as mx

    arrays, header = read_cache_file(path)
    metadata = user_metadata(header)
    digests = named_blocks(header)
    if "blocks" not in metadata:
        return rebuild_cache(arrays, header, path), metadata
    size = int(metadata.get("block_tokens", "0"))
    parts: dict[str, list[Any]] = {}
    for digest in digests:
        file = block_file(Path(path).parent, digest)
        if not file.is_file():
            raise EngineError(f"A block of the saved cache {path} is missing ({file.name}).")
        block, _ = read_cache_file(file)
        for key, a in block.items():
            if a.shape[2] != size:
                raise EngineError(f"The saved block {file.name} is damaged (its length is not {size}).")
            parts.setdefault(key, []).append(a)
    for key, a in arrays.items():
        parts.setdefault(key, []).append(a)
    joined = {key: p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for key, p in parts.items()}
    tokens = len(json.loads(metadata.get("token_ids", "[]")))
    if any(a.shape[2] != tokens for a in joined.values()):
        raise EngineError(f"The saved cache {path} does not match its blocks; delete it.")
    return rebuild_cache(joined, header, path), metadata


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
        cache, metadata = load_saved(path)
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
