"""The buffers under the attention caches: how long they grow, and keys and values of one
shape held in one buffer (``OneBuffer``) that a decode step fills with one write.

``engine.models.kv_cache`` builds its caches on these; the batch cache
(``engine.decode.batch_cache``) shares ``OneBuffer``."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

# Grow buffers this many tokens at a time: a decode step then only writes a slice.
DEFAULT_STEP = 256

# MLX's CUDA attention sends a one-query pass whose keys are a slice of a buffer a multiple
# of 256 tokens long (mlx-lm's cache) to cuDNN, and any other to its own vector kernel. On
# an H200 the vector kernel was the faster while rows x keys stayed small (a layer over one
# row of 512 keys: 6 against 13 us; eight rows of 700: 27 against 41) and cuDNN beyond (one
# row of 8,000: 25 against 33; eight rows of 1,000: 29 against 32, of 4,096: 44 against 127).
# So a buffer of at most ``VECTOR_KERNEL_TOKENS`` tokens over all its rows holds
# ``SPARE_TOKENS`` past its whole steps, which sends its decode steps to the vector kernel
# (docs/performance.md); ``MLX_DESK_CUDNN_DECODE=1`` keeps whole steps (no pad).
SPARE_TOKENS = 8
DECODE_KERNEL_PAD = 0 if os.environ.get("MLX_DESK_CUDNN_DECODE") == "1" else SPARE_TOKENS
VECTOR_KERNEL_TOKENS = 6144


def whole_steps(needed: int, step: int = DEFAULT_STEP) -> int:
    """``needed`` tokens rounded up to whole steps."""
    return -(-needed // step) * step


def buffer_tokens(needed: int, step: int = DEFAULT_STEP, rows: int = 1) -> int:
    """A buffer's length for ``needed`` tokens of ``rows`` rows: whole steps, and the pad
    that picks the decode kernel while the buffer is short."""
    whole = whole_steps(needed, step)
    return whole + (DECODE_KERNEL_PAD if rows * whole <= VECTOR_KERNEL_TOKENS else 0)


class Buffers:
    """What both caches share about their key and value buffers."""

    keys: mx.array | None
    values: mx.array | None
    offset: int

    def empty(self) -> bool:
        return self.keys is None or self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (their full capacity, which is what is allocated)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


# Keys and values as attention steps hand them on: stacked [2, B, heads, L, head_dim] (the CUDA
# heads kernel's output, which ``KVCache`` writes with one update) or a (keys, values) pair.
KV = Any


def split_kv(kv: KV) -> tuple[mx.array, mx.array]:
    """Keys and values of a ``KV``: a stack's two halves (views) or the pair as it is."""
    if isinstance(kv, mx.array):
        return half(kv, 0), half(kv, 1)
    return kv


def half(stack: mx.array, i: int) -> mx.array:
    """``stack[i]`` as a view: MLX takes a lone integer index as a gather, which copies (half
    a cache buffer every read), where an integer beside a slice is a view."""
    return stack[i, :]


class OneBuffer:
    """Keys and values of one shape and dtype (every family's but latent attention's) in one
    buffer [2, B, heads, capacity, head_dim]: a step whose keys and values come stacked (the
    CUDA heads kernel's output) writes them with one update where two buffers took two, one op
    fewer a layer in a step whose time follows its op count (docs/qmv.md). ``keys`` and
    ``values`` read its halves; arrays set from outside (a loaded state, a batch's joined rows)
    stay two buffers until the next growth copies them into one. For ``KVCache`` and the
    batch's cache."""

    stacks_kv = True
    buffer: mx.array | None = None  # [2, B, heads, capacity, head_dim]
    _keys: mx.array | None = None  # keys and values that do not share a buffer
    _values: mx.array | None = None

    @property
    def keys(self) -> mx.array | None:
        return half(self.buffer, 0) if self.buffer is not None else self._keys

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        self._unstack()
        self._keys = value

    @property
    def values(self) -> mx.array | None:
        return half(self.buffer, 1) if self.buffer is not None else self._values

    @values.setter
    def values(self, value: mx.array | None) -> None:
        self._unstack()
        self._values = value

    def _unstack(self) -> None:
        """Hold the keys and values as two arrays, so one can be replaced on its own."""
        if self.buffer is not None:
            self._keys, self._values, self.buffer = half(self.buffer, 0), half(self.buffer, 1), None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values for the new tokens; return all cached keys/values."""
        start, end = self._make_room(keys, values, keys.shape[2])
        return self._write(start, end, keys, values)

    def update_and_fetch_stacked(self, kv: mx.array) -> tuple[mx.array, mx.array]:
        """``update_and_fetch`` of keys and values stacked [2, B, heads, L, head_dim]: one write."""
        start, end = self._make_room(kv, None, kv.shape[3])
        return self._write_stacked(start, end, kv)

    def write(self, kv: KV, step: int | None = None) -> mx.array:
        """Append keys and values (``KV``: stacked or a pair) and return the whole buffer [2, B,
        heads, capacity, head_dim], not views of what is written: a compiled step reads it
        with the key count as an input (``decode_attention_cuda.attend_counted``). For a cache
        that holds one buffer (``buffer`` set). ``step``, where given, is the growth step in
        place of the cache's own, and a buffer shorter than one such step grows to it at once
        (``capacity_after``)."""
        if isinstance(kv, mx.array):
            start, end = self._make_room(kv, None, kv.shape[3], step)
        else:
            start, end = self._make_room(kv[0], kv[1], kv[0].shape[2], step)
        self._store(start, end, kv)
        return self.buffer

    def capacity_after(self, n: int, step: int | None = None) -> int:
        """The buffer's capacity once ``n`` more tokens are written (``write``'s ``step``)."""
        rows = self.buffer.shape[1] if self.buffer is not None else 1
        grown = self._grown(self._columns_used() + n, step, rows)
        return self._capacity() if grown is None else grown

    def _grown(self, end: int, step: int | None, rows: int) -> int | None:
        """The capacity to grow to before tokens up to ``end`` are written, or None where the
        buffer holds them. With a ``step`` of its own (a compiled step that traces once a
        capacity: ``write``) a shorter buffer grows to one step even where they fit, so a
        cache filled by a prompt is not traced again a few tokens later."""
        if step is None:
            return buffer_tokens(end, self.step, rows) if end > self._capacity() else None
        if end > self._capacity() or self._capacity() < step:
            return buffer_tokens(end, step, rows)
        return None

    def _make_room(self, keys: mx.array, values: mx.array | None, n: int, step: int | None = None) -> tuple[int, int]:
        """Grow (``_grown``) where ``n`` more tokens do not fit (``values`` None: ``keys``
        holds both, stacked), the buffer written in place between growths; move the tokens in
        use past them; the tokens to write, (start, end)."""
        start = self._columns_used()
        end = start + n
        # The plain step's test first, inline: every layer makes room every token.
        if end > self._capacity() or step is not None:
            capacity = self._grown(end, step, keys.shape[1] if values is None else keys.shape[0])
            if capacity is not None:
                k, v = split_kv(keys) if values is None else (keys, values)
                self._regrow(k, v, capacity, start)
        self._use_columns(end)
        return start, end

    def _columns_used(self) -> int:
        """Tokens (columns of the buffer) written so far: the owner's own count."""
        raise NotImplementedError

    def _use_columns(self, end: int) -> None:
        raise NotImplementedError

    def pending_arrays(self) -> list[mx.array]:
        """The arrays a pass wrote into (the one buffer, or the two), which a caller evaluates
        after a pass rather than ``state``: views held until the next pass would keep the
        buffer as it was, so that pass's write could not reuse it in place (a copy each)."""
        held = (self.buffer,) if self.buffer is not None else (self._keys, self._values)
        return [a for a in held if a is not None]

    def _capacity(self) -> int:
        """Tokens the buffers hold room for (read without building views)."""
        if self.buffer is not None:
            return self.buffer.shape[3]
        return 0 if self._keys is None else self._keys.shape[2]

    def _regrow(self, keys: mx.array, values: mx.array, capacity: int, held: int) -> None:
        """Buffers of ``capacity`` tokens shaped for ``keys``/``values`` (rows, heads, dims),
        one where they share a shape and dtype, the first ``held`` tokens copied over."""
        b, h, _, dk = keys.shape
        held_kv = (self.keys, self.values) if held and self._capacity() else None
        if values.shape[1] == h and values.shape[3] == dk and values.dtype == keys.dtype:
            buffer = mx.zeros((2, b, h, capacity, dk), keys.dtype)
            if held_kv is not None:
                buffer[0, :, :, :held] = held_kv[0][:, :, :held]
                buffer[1, :, :, :held] = held_kv[1][:, :, :held]
            self.buffer, self._keys, self._values = buffer, None, None
            return
        new_k = mx.zeros((b, h, capacity, dk), keys.dtype)
        new_v = mx.zeros((b, values.shape[1], capacity, values.shape[3]), values.dtype)
        if held_kv is not None:
            new_k[:, :, :held] = held_kv[0][:, :, :held]
            new_v[:, :, :held] = held_kv[1][:, :, :held]
        self.buffer, self._keys, self._values = None, new_k, new_v

    def _write(self, start: int, end: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write tokens [start, end) (room made); all keys and values up to ``end``."""
        self._store(start, end, (keys, values))
        return self._fetch(end)

    def _write_stacked(self, start: int, end: int, kv: mx.array) -> tuple[mx.array, mx.array]:
        """``_write`` of keys and values stacked [2, B, heads, L, head_dim]: one update."""
        self._store(start, end, kv)
        return self._fetch(end)

    def _store(self, start: int, end: int, kv: KV) -> None:
        """Write tokens [start, end) (room made) of ``KV``, stacked (one update where one
        buffer holds both) or a pair. Written with the token axis's position rather than an
        ellipsis: MLX parses these indices on every call, and each decode step does this once
        a layer."""
        if self.buffer is None:  # two buffers, set from outside
            keys, values = split_kv(kv)
            self._keys[:, :, start:end] = keys
            self._values[:, :, start:end] = values
        elif isinstance(kv, mx.array):
            self.buffer[:, :, :, start:end] = kv
        else:
            self.buffer[0, :, :, start:end] = kv[0]
            self.buffer[1, :, :, start:end] = kv[1]

    def _fetch(self, end: int) -> tuple[mx.array, mx.array]:
        """Views of the keys and values of tokens [0, end)."""
        if self.buffer is not None:
            return self.buffer[0, :, :, :end], self.buffer[1, :, :, :end]
        return self._keys[:, :, :end], self._values[:, :, :end]
