"""A KV cache held in affine 8- or 4-bit groups, for long contexts in less memory.

Keys and values are quantized as they arrive (``mx.quantize``, the same affine scheme as
MLX's quantized weights and mlx-lm's QuantizedKVCache: per group of ``group_size``
values along the head dimension, a scale and a bias) and stored packed. A decode step or a
verify pass (up to 32 queries, plain attention) reads the codes directly: on Metal with
quantized matmuls, as mlx-lm does there; on CUDA with fused kernels of our own
(models.quantized_attention_cuda), since MLX's CUDA quantized matmul over a 32k-token cache
decoded at half the speed of dequantizing first (29 against 59 tok/s at 4 bits, H200), and
dequantizing first at a third of a full-precision cache's speed. Longer passes, attentions
with their own twists (sinks, soft caps) and the CPU read them dequantized, so every
family's attention runs unchanged. At 8 bits with groups of 64 the cache takes ~0.53 of
bf16's bytes, at 4 bits ~0.28.

Only full-attention layers are quantized (``quantize_caches``): a sliding-window layer's
cache is small and fixed already, and latent (MLA) and recurrent caches are not keys
and values per head. Trimming, saving and loading work as for ``KVCache``, so prefix
reuse, speculative rewind and saved chats cover it.

A model folder may ship ``kv_config.json`` with per-layer settings (``kv_layer_settings``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import EngineError
from engine.files import SETTINGS_LIMIT, read_text_bounded
from engine.models import quantized_attention_cuda as fused_cuda
from engine.models.cache_buffers import DEFAULT_STEP
from engine.models.kv_cache import KVCache, _mask_for, register_cache_kind

BITS = (4, 8)
# Whether short passes attend over the stored codes (``QuantizedKVCache.attend``): on Metal
# with quantized matmuls (mlx-lm's quantized attention), on CUDA with our fused kernels
# (models.quantized_attention_cuda); the CPU dequantizes first.
READS_CODES = mx.metal.is_available() or fused_cuda.available()
GROUP_SIZES = (32, 64, 128)
KV_CONFIG = "kv_config.json"


def check_kv_settings(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise EngineError(f"KV bits must be 4 or 8 (got {bits}); leave it out for full precision.")
    if group_size not in GROUP_SIZES:
        raise EngineError(f"The KV group size must be 32, 64 or 128 (got {group_size}).")


def _group_for(dim: int, wanted: int) -> int | None:
    """The requested group size, or the largest smaller one that divides ``dim``."""
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= wanted and dim % g == 0:
            return g
    return None


def _layout(heads: int, dim: int, wanted: int) -> tuple[int, int]:
    """(group size, heads packed per row): groups run along each head's dimension; a head
    too narrow for the smallest group (a tiny model's head of 8) packs all its token's
    heads in one row, grouped across them."""
    group = _group_for(dim, wanted)
    if group is not None:
        return group, 0
    group = _group_for(heads * dim, wanted)
    if group is not None:
        return group, heads
    raise EngineError(
        f"This model's KV rows ({heads} heads of {dim}) cannot be held in quantized groups of "
        "32, 64 or 128; use a full-precision KV cache (no --kv-bits)."
    )


@register_cache_kind
class QuantizedKVCache:
    """A growing cache like ``KVCache`` whose keys and values are stored quantized:
    each is a triple (packed uint32 codes, scales, biases), shaped [B, heads, tokens, ...]."""

    def __init__(self, bits: int = 8, group_size: int = 64, step: int = DEFAULT_STEP):
        check_kv_settings(bits, group_size)
        self.bits, self.group_size, self.step = bits, group_size, step
        self.keys: tuple[mx.array, ...] | None = None
        self.values: tuple[mx.array, ...] | None = None
        self.offset = 0
        self._groups = (group_size, group_size)  # the effective (key, value) group sizes
        self._packed = (0, 0)  # heads packed per row for keys, values (0: one head per row)
        self.dtype = mx.float16  # what keys and values are read back as

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> QuantizedKVCache:
        return cls(int(meta["bits"]), int(meta["group_size"]))

    # -- writing and reading -----------------------------------------------------------

    def _quantize(self, x: mx.array, group: int, packed: int) -> tuple[mx.array, ...]:
        if packed:  # [B, H, T, D] -> [B, 1, T, H*D]
            b, h, t, d = x.shape
            x = x.transpose(0, 2, 1, 3).reshape(b, 1, t, h * d)
        return tuple(mx.quantize(x, group_size=group, bits=self.bits))

    def _read(self, triple: tuple[mx.array, ...], group: int, packed: int, end: int) -> mx.array:
        w, scales, biases = (a[..., :end, :] for a in triple)
        x = mx.dequantize(w, scales, biases, group_size=group, bits=self.bits).astype(self.dtype)
        if packed:
            b, _, t, width = x.shape
            x = x.reshape(b, t, packed, width // packed).transpose(0, 2, 1, 3)
        return x

    def _grow(self, new: tuple[mx.array, ...], held: tuple[mx.array, ...] | None, needed: int):
        capacity = ((needed + self.step - 1) // self.step) * self.step
        grown = []
        for i, part in enumerate(new):
            b, h, _, width = part.shape
            buf = mx.zeros((b, h, capacity, width), part.dtype)
            if held is not None and self.offset:
                buf[..., : self.offset, :] = held[i][..., : self.offset, :]
            grown.append(buf)
        return tuple(grown)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new tokens' keys/values quantized; return all of them, dequantized."""
        self.store(keys, values)
        return (
            self._read(self.keys, self._groups[0], self._packed[0], self.offset),
            self._read(self.values, self._groups[1], self._packed[1], self.offset),
        )

    def store(self, keys: mx.array, values: mx.array) -> None:
        """Append the new tokens' keys/values, quantized."""
        prev, n = self.offset, keys.shape[2]
        if self.keys is None:
            (gk, pk), (gv, pv) = (_layout(x.shape[1], x.shape[-1], self.group_size) for x in (keys, values))
            self._groups, self._packed = (gk, gv), (pk, pv)
            self.dtype = keys.dtype
        qk = self._quantize(keys, self._groups[0], self._packed[0])
        qv = self._quantize(values, self._groups[1], self._packed[1])
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            self.keys, self.values = self._grow(qk, self.keys, prev + n), self._grow(qv, self.values, prev + n)
        for buf, part in zip((*self.keys, *self.values), (*qk, *qv)):
            buf[..., prev : prev + n, :] = part
        self.offset = prev + n

    @property
    def reads_codes(self) -> bool:
        return READS_CODES

    def attends_quantized(self, keys: mx.array, values: mx.array) -> bool:
        """Whether ``attend`` can read keys/values shaped like these as stored: each head
        in rows of its own (a packed tiny head is dequantized instead)."""
        return not any(_layout(x.shape[1], x.shape[-1], self.group_size)[1] for x in (keys, values))

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        """Plain softmax attention of ``queries`` [B, heads, L, D] over everything stored,
        reading the codes: with fused kernels on CUDA (models.quantized_attention_cuda; a
        shape or mask they do not take is dequantized), with quantized matmuls on Metal
        (mlx-lm's quantized attention). For a few queries this reads the cache once, where
        dequantizing first reads it, writes it out at full precision and reads it again.

        On Metal the matmuls take the whole buffer, not a slice up to ``offset``: a slice of it is
        strided across heads, which MLX's CUDA kernels do not take; the few positions past
        ``offset`` (under one growth step) are masked out, and their codes are finite
        (zeros, or trimmed tokens), so they add exact zeros."""
        b, n_heads, n_q, d = queries.shape
        n_kv, capacity = self.keys[0].shape[1], self.keys[0].shape[2]
        if fused_cuda.available():  # the fused kernels, or dequantize where they do not fit
            if fused_cuda.fits(n_heads, n_kv, n_q, d, self._groups, mask):
                held = tuple(a[..., : self.offset, :] for a in (*self.keys, *self.values))
                return fused_cuda.attend(queries, scale, held[:3], held[3:], self.bits, self._groups)
            keys = self._read(self.keys, self._groups[0], self._packed[0], self.offset)
            values = self._read(self.values, self._groups[1], self._packed[1], self.offset)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        rep = n_heads // n_kv
        q = (queries * scale).reshape(b, n_kv, rep, n_q, d)
        keys = tuple(a[:, :, None] for a in self.keys)
        values = tuple(a[:, :, None] for a in self.values)
        kg, vg = self._groups
        scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=kg, bits=self.bits)
        # Query i (of the last n_q positions) sees keys up to its own position.
        positions = mx.arange(capacity)[None]
        visible = positions <= mx.arange(self.offset - n_q, self.offset)[:, None]
        if mask is not None and not isinstance(mask, str):  # a boolean or additive [.., L, offset] mask
            mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, capacity - mask.shape[-1])])
            if mask.ndim > 3:  # [B, 1, L, T]: one more axis for the heads sharing a KV head
                mask = mx.expand_dims(mask, -3)
            if mask.dtype == mx.bool_:
                visible = visible & mask
            else:
                scores = scores + mask
        scores = mx.where(visible, scores, mx.finfo(scores.dtype).min)
        weights = mx.softmax(scores, axis=-1, precise=True)
        out = mx.quantized_matmul(weights, *values, transpose=False, group_size=vg, bits=self.bits)
        return out.reshape(b, n_heads, n_q, -1)

    # -- size, trimming, masks -------------------------------------------------------------

    def empty(self) -> bool:
        return self.keys is None or self.offset == 0

    @property
    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def make_mask(self, n_queries: int, window: int | None = None):
        return _mask_for(self.offset, self.offset + n_queries, n_queries, window)

    # -- save / load -------------------------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.offset == 0:
            return ()
        return tuple(a[..., : self.offset, :] for a in (*self.keys, *self.values))

    @state.setter
    def state(self, value) -> None:
        if not value:
            self.keys = self.values = None
            self.offset = 0
            return
        value = tuple(value)
        self.keys, self.values = value[:3], value[3:]
        self.offset = self.keys[0].shape[2]
        self.dtype = self.keys[1].dtype  # the scales keep the model's dtype

    @property
    def meta_state(self) -> dict[str, str]:
        return {
            "offset": str(self.offset),
            "step": str(self.step),
            "bits": str(self.bits),
            "group_size": str(self.group_size),
            "groups": f"{self._groups[0]},{self._groups[1]}",
            "packed": f"{self._packed[0]},{self._packed[1]}",
        }

    @meta_state.setter
    def meta_state(self, value: dict[str, str]) -> None:
        self.bits, self.group_size = int(value["bits"]), int(value["group_size"])
        check_kv_settings(self.bits, self.group_size)
        self.step = int(value.get("step", DEFAULT_STEP))
        if "groups" in value:
            k, v = (int(g) for g in value["groups"].split(","))
            self._groups = (k, v)
        if "packed" in value:
            k, v = (int(p) for p in value["packed"].split(","))
            self._packed = (k, v)
        if "offset" in value:
            self.offset = int(value["offset"])


# -- choosing which layers are quantized ------------------------------------------------------

LayerSetting = tuple[int, int] | None  # (bits, group size), or None for full precision


def quantize_caches(cache: list, settings: list[LayerSetting]) -> list:
    """Replace each plain ``KVCache`` whose layer has a setting by a QuantizedKVCache
    (other kinds, and subclasses such as latent caches, stay as they are)."""
    out = []
    for i, c in enumerate(cache):
        setting = settings[i] if i < len(settings) else None
        if setting is not None and type(c) is KVCache and c.empty():
            c = QuantizedKVCache(*setting)
        out.append(c)
    return out


class KVQuantization:
    """What ``make_prompt_cache`` applies to a model's fresh caches (``model.kv_quantization``)."""

    def __init__(self, settings: list[LayerSetting]):
        self.settings = list(settings)

    def __call__(self, cache: list) -> list:
        return quantize_caches(cache, self.settings)


def describe(settings: list[LayerSetting]) -> str:
    """A short name for a setting ("" for full precision): "8-bit g64", "mixed 4/8-bit"...;
    saved caches record it, so a file made under another KV setting is not reused."""
    used = sorted({s for s in settings if s is not None})
    if not used:
        return ""
    if len(used) == 1 and all(s is not None for s in settings):
        return f"{used[0][0]}-bit g{used[0][1]}"
    return "per layer " + ",".join("-" if s is None else f"{s[0]}g{s[1]}" for s in settings)


def uniform(bits: int | None, group_size: int, layers: int) -> list[LayerSetting]:
    if bits is None:
        return [None] * layers
    check_kv_settings(bits, group_size)
    return [(bits, group_size)] * layers


def kv_layer_settings(folder: str | Path, layers: int) -> list[LayerSetting] | None:
    """Per-layer KV settings from the folder's ``kv_config.json``, None when it has none.

    Read forms: ``{"bits": 8, "group_size": 64}`` for every layer; ``{"layers": [...]}``
    with one entry per layer (``{"bits": 4, "group_size": 64}``, a bare bit count, or
    null / 16 for full precision); ``{"layers": {"3": {...}}}`` naming layers (others
    full precision). ``kv_bits`` / ``kv_group_size`` spell the same keys."""
    path = Path(folder) / KV_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(read_text_bounded(path, SETTINGS_LIMIT, "a KV cache setting", EngineError))
    except (OSError, ValueError) as exc:
        raise EngineError(f"Cannot read {path}: {exc}. Fix or delete it.") from None

    def one(entry: Any, default_group: int) -> LayerSetting:
        if entry is None:
            return None
        if isinstance(entry, int | float):
            entry = {"bits": entry}
        if not isinstance(entry, dict):
            raise EngineError(f"{path}: a layer's setting must be an object or a bit count (got {entry!r}).")
        bits = entry.get("bits", entry.get("kv_bits"))
        if bits is None or int(bits) >= 16:
            return None
        group = int(entry.get("group_size", entry.get("kv_group_size", default_group)))
        check_kv_settings(int(bits), group)
        return int(bits), group

    if not isinstance(data, dict):
        raise EngineError(f"{path} must hold a JSON object.")
    group = int(data.get("group_size", data.get("kv_group_size", 64)))
    per_layer = data.get("layers", data.get("per_layer"))
    if per_layer is None:
        return [one(data, group)] * layers
    if isinstance(per_layer, list):
        if len(per_layer) != layers:
            raise EngineError(f"{path} lists {len(per_layer)} layers; the model has {layers}.")
        return [one(e, group) for e in per_layer]
    if isinstance(per_layer, dict):
        out: list[LayerSetting] = [None] * layers
        for key, entry in per_layer.items():
            i = int(key)
            if not 0 <= i < layers:
                raise EngineError(f"{path} names layer {i}; the model has {layers}.")
            out[i] = one(entry, group)
        return out
    raise EngineError(f'{path}: "layers" must be a list or an object.')


def kv_bytes_per_token_factor(bits: int, group_size: int, dtype_bytes: int) -> float:
    """Bytes of one quantized value (codes plus its share of the group's scale and bias)
    over the bytes of one full-precision value."""
    return (bits / 8 + 2 * dtype_bytes / group_size) / dtype_bytes
