"""Key/value caches for attention, passed to the model explicitly.

Two kinds:

* ``KVCache`` keeps every token. Its buffers grow in steps of ``step`` tokens so a
  decode step writes into preallocated memory instead of concatenating.
* ``RotatingKVCache(max_size, keep=0)`` keeps at most ``max_size`` tokens, for
  sliding-window attention layers: once full, a new token overwrites the oldest one
  (the first ``keep`` tokens are never overwritten).

Both can be trimmed (drop the last n tokens), which gives prefix reuse across chat
turns and speculative rewind with one mechanism, and both save to / load from a
safetensors file (no pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import EngineError
from engine.models.cache_buffers import DEFAULT_STEP, Buffers, OneBuffer


class KVCache(OneBuffer, Buffers):
    """A growing cache of keys and values, shaped [B, n_kv_heads, tokens, head_dim], in one
    buffer where they share a shape (``OneBuffer``)."""

    def __init__(self, step: int = DEFAULT_STEP):
        self.buffer = self._keys = self._values = None
        self.offset = 0
        self.step = step

    def _columns_used(self) -> int:
        return self.offset

    def _use_columns(self, end: int) -> None:
        self.offset = end

    # -- size and trimming ---------------------------------------------------------

    @property
    def size(self) -> int:
        """How many tokens the attention sees (equals ``offset`` for this cache)."""
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; return how many were dropped."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    # -- save / load ---------------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        if self.keys is None or self.offset == 0:
            return ()
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, value) -> None:
        if not value:
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values = value
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset), "step": str(self.step)}

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        self.step = int(value.get("step", DEFAULT_STEP))
        if "offset" in value:
            self.offset = int(value["offset"])

    def make_mask(self, n_queries: int, window: int | None = None):
        """The attention mask for ``n_queries`` new tokens (call before the update)."""
        return _mask_for(self.offset, self.offset + n_queries, n_queries, window)

    def held(self) -> tuple[mx.array, mx.array]:
        """The cached keys and values, oldest first, without adding to them."""
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class RotatingKVCache(Buffers):
    """Keeps the last ``max_size`` tokens (plus the first ``keep``) for sliding-window layers.

    Decode steps write into a fixed ring buffer. A multi-token update returns the
    tokens in time order (the last ``max_size - 1`` old ones and all new ones), so a
    prefill chunk longer than the window still sees exactly its window per query;
    ``make_mask`` gives the matching mask.
    """

    def __init__(self, max_size: int, keep: int = 0, step: int = DEFAULT_STEP):
        if max_size <= 0 or keep < 0 or keep >= max_size:
            raise EngineError(f"A rotating cache needs 0 <= keep < max_size (got keep={keep}, max_size={max_size}).")
        self.max_size = max_size
        self.keep = keep
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # tokens seen in total
        self._idx = 0  # next write position in the buffer
        self._ordered = True  # buffer[:size] is in time order

    @property
    def size(self) -> int:
        """How many tokens are held (what the attention sees after the next fetch)."""
        return min(self.offset, self.max_size)

    def _in_time_order(self, a: mx.array) -> mx.array:
        """The held tokens, oldest first."""
        if self._ordered or self._idx == self.keep:
            return a[..., : self.size, :] if self._ordered else a
        return mx.concatenate(
            [a[..., : self.keep, :], a[..., self._idx :, :], a[..., self.keep : self._idx, :]],
            axis=2,
        )

    def held(self) -> tuple[mx.array, mx.array]:
        """The held keys and values, oldest first, without adding to them."""
        return self._in_time_order(self.keys), self._in_time_order(self.values)

    def _update_many(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            k, v = keys, values
        else:
            old_k = self._in_time_order(self.keys)
            old_v = self._in_time_order(self.values)
            # Queries of this chunk look back at most max_size - 1 tokens before themselves.
            drop = old_k.shape[2] - (self.max_size - 1)
            if drop > 0:
                old_k = mx.concatenate([old_k[..., : self.keep, :], old_k[..., self.keep + drop :, :]], 2)
                old_v = mx.concatenate([old_v[..., : self.keep, :], old_v[..., self.keep + drop :, :]], 2)
            k = mx.concatenate([old_k, keys], axis=2)
            v = mx.concatenate([old_v, values], axis=2)
        self.offset += keys.shape[2]
        # Keep what future tokens may need: the first `keep` and the last max_size - keep.
        excess = k.shape[2] - self.max_size
        if excess > 0:
            self.keys = mx.concatenate([k[..., : self.keep, :], k[..., self.keep + excess :, :]], 2)
            self.values = mx.concatenate([v[..., : self.keep, :], v[..., self.keep + excess :, :]], 2)
        else:
            self.keys, self.values = k, v
        self._ordered = True
        self._idx = self.keys.shape[2]
        return k, v

    def _update_one(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self._grow_by_step(keys, values)
        slot, seen = self.reserve_one()
        self.keys[..., slot : slot + 1, :] = keys
        self.values[..., slot : slot + 1, :] = values
        self.commit_one(self.keys, self.values)
        if seen < self.keys.shape[2]:
            return self.keys[..., :seen, :], self.values[..., :seen, :]
        return self.keys, self.values

    def _grow_by_step(self, keys: mx.array, values: mx.array) -> None:
        """Still filling: grow the buffer by a step, never beyond max_size."""
        b, h, _, dk = keys.shape
        dv = values.shape[3]
        held = 0 if self.keys is None else self._idx
        grow = min(self.step, self.max_size - held)
        new_k = mx.zeros((b, h, held + grow, dk), keys.dtype)
        new_v = mx.zeros((b, h, held + grow, dv), values.dtype)
        if held:
            new_k[..., :held, :] = self.keys[..., :held, :]
            new_v[..., :held, :] = self.values[..., :held, :]
        self.keys, self.values = new_k, new_v

    def reserve_one(self) -> tuple[int, int]:
        """Make room for one more token (buffers must exist); return (the slot it will be
        written to, how many leading slots the attention then sees)."""
        if self._idx >= self.keys.shape[2] and self.keys.shape[2] < self.max_size:
            self._grow_by_step(self.keys, self.values)
        if self._idx >= self.max_size:
            self._idx = self.keep  # wrap around, sparing the kept prefix
            self._ordered = False
        slot = self._idx
        return slot, (slot + 1 if self._ordered else self.keys.shape[2])

    def commit_one(self, keys: mx.array, values: mx.array) -> None:
        """Take the buffers with the token reserved by ``reserve_one`` written in."""
        self.keys, self.values = keys, values
        self._idx += 1
        self.offset += 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            return self._update_one(keys, values)
        return self._update_many(keys, values)

    def make_mask(self, n_queries: int, window: int | None = None):
        """The attention mask for ``n_queries`` new tokens (call before the update)."""
        window = self.max_size if window is None else min(window, self.max_size)
        if n_queries == 1:
            return None  # the buffer holds exactly the window
        held_before = min(self.offset, self.max_size - 1)
        return _mask_for(self.offset, held_before + n_queries, n_queries, window, self.keep)

    # -- trimming ------------------------------------------------------------------

    def is_trimmable(self) -> bool:
        # Once tokens have been overwritten they cannot be brought back.
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = max(0, min(self.offset, n))
        self.offset -= n
        self._idx -= n
        return n

    # -- save / load ---------------------------------------------------------------

    @property
    def state(self):
        if self.keys is None or self.offset == 0:
            return ()
        return self._in_time_order(self.keys), self._in_time_order(self.values)

    @state.setter
    def state(self, value) -> None:
        if not value:
            self.keys = self.values = None
            self.offset = self._idx = 0
            self._ordered = True
            return
        self.keys, self.values = value
        self._idx = self.keys.shape[2]
        self._ordered = True
        self.offset = max(self.offset, self._idx)

    @property
    def meta_state(self) -> dict[str, str]:
        return {
            "offset": str(self.offset),
            "max_size": str(self.max_size),
            "keep": str(self.keep),
            "step": str(self.step),
        }

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        self.max_size = int(value["max_size"])
        self.keep = int(value.get("keep", 0))
        self.step = int(value.get("step", DEFAULT_STEP))
        self.offset = int(value["offset"])


def _mask_for(offset: int, n_keys: int, n_queries: int, window: int | None, keep: int = 0):
    """Mask for queries at positions offset..offset+n_queries-1 over ``n_keys`` keys.

    Keys are in time order and end at the last query. Returns None (no mask
    needed), the string "causal" (the fast kernel's own causal mask), or a boolean
    array [n_queries, n_keys] where True means "may attend".
    """
    if n_queries == 1 and (window is None or n_keys <= window):
        return None
    if window is None or offset + n_queries <= window:
        return "causal"
    q_pos = mx.arange(offset, offset + n_queries)[:, None]
    first = offset + n_queries - n_keys  # position of the oldest key after the kept ones
    index = mx.arange(n_keys)
    k_pos = index + first
    if keep:
        k_pos = mx.where(index < keep, index, k_pos)
    k_pos = k_pos[None, :]
    in_window = q_pos - k_pos < window
    if keep:
        in_window = in_window | (index[None, :] < keep)  # kept tokens stay visible
    return (k_pos <= q_pos) & in_window


# -- whole-model functions ------------------------------------------------------------


def make_prompt_cache(model) -> list:
    """One cache per layer, of the kind each layer needs. ``model.kv_quantization`` (set by
    the host from --kv-bits or kv_config.json: quantized_kv_cache.KVQuantization) swaps
    the full-attention layers' caches for quantized ones; ``model.kv_pool`` (--paged-kv:
    paged_kv.ModelPool) then pages them, quantized or not."""
    cache = list(model.make_cache()) if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    quantization = getattr(model, "kv_quantization", None)
    if quantization is not None:
        cache = quantization(cache)
    pool = getattr(model, "kv_pool", None)  # --paged-kv: full-attention layers in shared blocks
    return pool.page(cache) if pool is not None else cache


def cache_length(cache: Sequence[Any]) -> int:
    """Tokens the cache has seen (its offset); 0 for an empty cache list."""
    return int(cache[0].offset) if cache else 0


def rewind_point(cache: Sequence[Any], keep: int) -> int:
    """The longest prefix of at most ``keep`` tokens every layer can return to. Attention
    layers can go back anywhere; a recurrent layer only to a state it kept a copy of (turn
    boundaries, engine/models/recurrent_cache.py), never to a state rebuilt wrongly."""
    for c in cache:
        nearest = getattr(c, "nearest", None)
        if nearest is not None:
            keep = min(keep, nearest(keep))
    return keep


def checkpoint(cache: Sequence[Any] | None) -> None:
    """Let recurrent layers keep a copy of their current state (a turn boundary)."""
    for c in cache or ():
        getattr(c, "checkpoint", lambda: None)()


def can_trim_prompt_cache(cache: list, n: int | None = None) -> bool:
    """Whether every layer can drop tokens (``n`` of them: a recurrent layer only can when it
    kept a copy of its state there)."""
    return all(c.is_trimmable() and (n is None or getattr(c, "can_trim", lambda _: True)(n)) for c in cache)


def trim_prompt_cache(cache: list, n: int) -> int:
    """Drop the last ``n`` tokens of every layer; return how many every layer dropped (0
    when some layer cannot trim). Trimming 0 always succeeds, so ``== n`` means done."""
    if n == 0:
        return 0
    if not cache or not can_trim_prompt_cache(cache, n):
        return 0
    return min(c.trim(n) for c in cache)


# Every cache class a prompt cache file may hold, by class name. A cache kind defined
# elsewhere (recurrent state, latent attention, quantized KV) registers itself here; it
# offers ``state`` (a tuple of arrays, empty when it holds nothing), ``meta_state`` (a dict
# of strings) and either a ``from_meta(meta)`` classmethod or a no-argument constructor.
CACHE_KINDS: dict[str, type] = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}
_FORMAT = "mlx-desk-prompt-cache/2"


def register_cache_kind(cls: type) -> type:
    """Class decorator: let ``save_prompt_cache``/``load_prompt_cache`` handle ``cls``."""
    CACHE_KINDS[cls.__name__] = cls
    return cls


def _empty_like(kind: type, meta: dict[str, str]) -> Any:
    if hasattr(kind, "from_meta"):
        return kind.from_meta(meta)
    if kind is RotatingKVCache:
        return kind(int(meta["max_size"]))
    return kind()


def cache_arrays(cache: list) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Each layer's arrays (``"layer.slot"``) and the header that says how to rebuild the
    cache from them (``rebuild_cache``): what a cache file holds."""
    arrays: dict[str, mx.array] = {}
    layers: list[dict[str, Any]] = []
    for i, c in enumerate(cache):
        if hasattr(c, "arrays"):  # a recurrent layer: its state slots (snapshots stay behind)
            present = [j for j, a in enumerate(c.arrays) if a is not None]
            arrays.update({f"{i}.{j}": c.arrays[j] for j in present})
            layers.append({"kind": type(c).__name__, "meta": c.meta_state, "slots": len(c.arrays), "present": present})
            continue
        state = tuple(c.state or ())
        for j, a in enumerate(state):
            arrays[f"{i}.{j}"] = a
        layers.append({"kind": type(c).__name__, "meta": c.meta_state, "arrays": len(state)})
    return arrays, {"format": _FORMAT, "layers": json.dumps(layers)}


def save_prompt_cache(path: str | Path, cache: list, metadata: dict[str, str] | None = None) -> None:
    """Write the cache (each layer's arrays and settings) to a safetensors file, atomically:
    a temporary file is written beside it and renamed over it, so a crash or a full disk
    never leaves a half-written cache under the real name."""
    arrays, header = cache_arrays(cache)
    write_cache_file(path, arrays, header, metadata)


def write_cache_file(
    path: str | Path, arrays: dict[str, mx.array], header: dict[str, str], metadata: dict[str, str] | None = None
) -> None:
    """``arrays`` under ``header`` and ``metadata`` (as ``user.`` keys), written atomically."""
    header = {**header, **{f"user.{key}": str(value) for key, value in (metadata or {}).items()}}
    path = Path(path)
    if path.suffix != ".safetensors":
        raise EngineError(f"A prompt cache file must end in .safetensors (got {path}).")
    partial = path.with_name(f".{path.stem}.partial.safetensors")
    try:
        mx.save_safetensors(str(partial), arrays, header)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


def read_cache_file(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A cache file's arrays and header; a damaged, truncated or foreign file raises EngineError."""
    try:
        arrays, header = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError on bad files
        raise EngineError(f"Cannot read the prompt cache {path}: {exc}. Delete it to start afresh.") from exc
    if header.get("format") != _FORMAT:
        raise EngineError(f"{path} is not a prompt cache written by this program; delete it.")
    return arrays, header


def load_prompt_cache(path: str | Path) -> tuple[list, dict[str, str]]:
    """Read a file written by ``save_prompt_cache``; return (cache, metadata). A damaged,
    truncated or foreign file raises EngineError."""
    arrays, header = read_cache_file(path)
    return rebuild_cache(arrays, header, path), user_metadata(header)


def user_metadata(header: dict[str, str]) -> dict[str, str]:
    return {k[len("user.") :]: v for k, v in header.items() if k.startswith("user.")}


def rebuild_cache(arrays: dict[str, mx.array], header: dict[str, str], path: str | Path) -> list:
    """The cache ``cache_arrays`` described (``path`` names it in errors)."""
    cache = []
    try:
        for i, layer in enumerate(json.loads(header["layers"])):
            kind = CACHE_KINDS.get(layer["kind"])
            if kind is None:
                raise EngineError(f"{path} holds an unknown cache kind {layer['kind']!r}; delete it.")
            meta = layer["meta"]
            c = _empty_like(kind, meta)
            if "slots" in layer:  # a recurrent layer
                c.arrays = [arrays[f"{i}.{j}"] if j in layer["present"] else None for j in range(layer["slots"])]
                c.meta_state = meta
                cache.append(c)
                continue
            c.meta_state = meta
            state = tuple(arrays[f"{i}.{j}"] for j in range(int(layer["arrays"])))
            if state:
                c.state = state
                c.meta_state = meta  # restore offset (may exceed what a rotating cache holds)
            cache.append(c)
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineError(f"The prompt cache {path} is damaged ({exc}); delete it.") from None
    return cache


def copy_prompt_cache(cache: Sequence[Any], rows: int = 1) -> list:
    """A new cache holding what ``cache`` (one sequence) holds, repeated for ``rows``
    sequences: what each layer saves (``state``/``meta_state``, or a recurrent layer's
    ``arrays``) rebuilt in a fresh object, so feeding the copy never changes ``cache``.
    Decision scoring gives every candidate its own copy of the prompt's keys and values."""

    from mlx.utils import tree_map

    def widen(a: Any) -> Any:  # an array, or the nested tuples a quantized layer saves
        if a is None or rows == 1:
            return a
        return tree_map(lambda x: mx.repeat(x, rows, axis=0), a)

    copies = []
    for c in cache:
        meta = c.meta_state
        fresh = _empty_like(type(c), meta)
        if hasattr(c, "arrays"):  # a recurrent layer: its live state slots
            fresh.arrays = [widen(a) for a in c.arrays]
            fresh.meta_state = meta
        else:
            fresh.meta_state = meta
            state = tuple(c.state or ())
            if state:
                fresh.state = tuple(widen(a) for a in state)
                fresh.meta_state = meta
        copies.append(fresh)
    return copies
