"""The batch's KV cache: one layer's keys and values for every row, and a prefix the rows share.

Rows are left-padded to the longest: row i's tokens sit in columns ``left[i]`` to ``idx``
of [rows, heads, tokens, dim] buffers, and the attention mask hides each row's padding.
Rows joining or leaving change the bookkeeping at once and the buffers when next read:
all the rows that join in a round in one concatenation, all that leave in one gather.

Shared prefixes. Rows whose paged caches start with the same published blocks (one system
prompt and tools, sent by eight agents) need not each hold those tokens: the batch keeps
them once, [1, heads, P, dim] (a ``prefixes`` entry, a slice of the pool's own blocks where
they form one run, so no copy at all), and a row that sees it holds only its tokens past P.
Up to ``MAX_PREFIXES`` prompts are shared at once (two kinds of agent, each with its own
system prompt); a row seeing none of them holds its own copy. Attention then runs in parts
over one softmax: every row's queries against each prefix (one matmul reading it once per
step for all rows, where gathering it into each row read it once per row), and each row's
queries against its own tokens; the scores are joined before the softmax and the weighted
sums added, so the result is attention over the row's prefix then its tokens, as one
contiguous row would give (to float rounding). A row has every prefix but its own masked
out. The scores are materialized (MLX's fused kernel takes one key array), so long query
passes run in slices that keep them under ``SCORE_ELEMENTS``.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from engine.models.cache_buffers import DEFAULT_STEP, OneBuffer

# Score elements (float32) one slice of a shared-prefix attention pass holds at most:
# 256 MB, the size of a 512-token prefill chunk's scores over a 4k prefix with 32 heads.
SCORE_ELEMENTS = 1 << 26
# Prefixes a batch shares at once: each costs every attention call a score pass over it.
MAX_PREFIXES = 4
# A row's ``sees`` when it follows no shared prefix.
NO_PREFIX = -1


class BatchKVCache(OneBuffer):
    """One layer's keys and values for all rows, shaped [rows, heads, tokens, dim] and
    left-padded: row i's tokens sit in columns ``left[i]`` to ``idx``; and the prefixes the
    rows share, row i's tokens following ``prefixes[sees[i]]`` (see the module's docstring).
    Keys and values share one buffer between growths (``OneBuffer``)."""

    def __init__(self, step: int = DEFAULT_STEP) -> None:
        self.buffer = self._keys = self._values = None
        self.left: list[int] = []
        self.idx = 0  # columns in use
        self.step = step
        self._left = mx.array([], dtype=mx.int32)  # ``left`` on the device, for masks
        self._base = mx.array([], dtype=mx.int32)  # each row's position when ``idx`` was ``_base_idx``
        self._base_idx = 0
        self._offset: tuple[int, mx.array] | None = None  # (idx, positions) last asked for
        self.prefixes: list[tuple[mx.array, mx.array]] = []  # [1, heads, P, dim] keys and values
        self.prefix_keys: list[tuple[Any, ...]] = []  # what each prefix is (the blocks it was read from)
        self.sees: list[int] = []  # per row: the prefix its tokens follow, or NO_PREFIX
        self._sees = mx.array([], dtype=mx.int32)
        # Rows added since the arrays were last built, joined in one concatenation when next
        # read (``_materialize``), and the columns the arrays held then.
        self._pending: list[tuple[mx.array | None, mx.array | None]] = []
        self._array_idx = 0
        # Rows taken out since the arrays were last built: the arrays' rows still held (None:
        # all of them), and the arrays' column where column 0 now is.
        self._rows: list[int] | None = None
        self._col0 = 0

    @property
    def attends_prefix(self) -> bool:
        """Attention goes through ``attend_with_prefix`` (engine.models.base.cached_attention)."""
        return bool(self.prefixes)

    def prefix_len(self, j: int) -> int:
        return 0 if j == NO_PREFIX else self.prefixes[j][0].shape[2]

    def prefix_for(self, run: tuple[Any, ...]) -> int:
        """The longest prefix whose blocks ``run`` starts with, or NO_PREFIX."""
        found = [(len(key), j) for j, key in enumerate(self.prefix_keys) if key and run[: len(key)] == key]
        return max(found)[1] if found else NO_PREFIX

    def share(self, key: tuple[Any, ...], keys: mx.array, values: mx.array) -> int:
        """Hold ``keys``/``values`` ([1, heads, P, dim]) as a prefix rows may see; its index."""
        assert len(self.prefixes) < MAX_PREFIXES
        self.prefixes.append((keys, values))
        self.prefix_keys.append(key)
        return len(self.prefixes) - 1

    def _refresh(self) -> None:
        seen = sorted(set(self.sees) - {NO_PREFIX})
        if len(seen) < len(self.prefixes):  # nobody reads the others: the pool's again
            moved = {old: new for new, old in enumerate(seen)}
            self.prefixes = [self.prefixes[j] for j in seen]
            self.prefix_keys = [self.prefix_keys[j] for j in seen]
            self.sees = [moved.get(j, NO_PREFIX) for j in self.sees]
        base = [self.idx - pad + self.prefix_len(j) for pad, j in zip(self.left, self.sees)]
        self._base = mx.array(base, dtype=mx.int32)
        self._base_idx, self._offset = self.idx, None
        self._left = mx.array(self.left, dtype=mx.int32)
        self._sees = mx.array(self.sees, dtype=mx.int32)

    @property
    def offset(self) -> mx.array:
        """Each row's next position (RoPE): one small op per step and only when asked for,
        where adding to it on every layer's update would queue one per layer."""
        if self._offset is None or self._offset[0] != self.idx:
            moved = self.idx - self._base_idx
            self._offset = (self.idx, self._base + moved if moved else self._base)
        return self._offset[1]

    def _pad_left(self, a: mx.array, n: int) -> mx.array:
        if n == 0:
            return a
        b, h, _, d = a.shape
        return mx.concatenate([mx.zeros((b, h, n, d), a.dtype), a], axis=2)

    def add(self, keys: mx.array | None, values: mx.array | None, sees: int = NO_PREFIX) -> None:
        """Append a row holding ``keys``/``values`` ([1, heads, n, dim], None for n = 0),
        following the prefix ``sees`` (NO_PREFIX: none). The arrays are joined when next
        read: rows joining in one round take one concatenation, where one each made a chain
        of growing copies that the next step computed with all of them alive (16 streams over
        512-token prompts peaked at 5.9x their keys and values)."""
        assert sees == NO_PREFIX or 0 <= sees < len(self.prefixes)
        if not self._pending:
            self._array_idx = self.idx
        n = 0 if keys is None else keys.shape[2]
        if n > self.idx:  # the newcomer is the longest: everyone else moves right
            grow = n - self.idx
            self.left = [pad + grow for pad in self.left]
            self.idx = n
        self._pending.append((keys, values))
        self.left.append(self.idx - n)
        self.sees.append(sees)
        self._refresh()

    def _materialize(self) -> None:
        """Join the rows added since the arrays were last built: the arrays (their columns
        moved right where a newcomer is longer) and each newcomer left-padded, in one
        concatenation; rows holding nothing are zeros."""
        self._gather_kept()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        old_rows = len(self.left) - len(pending)
        like = next((kv for kv in pending if kv[0] is not None), None)
        if like is None and self.keys is None:
            return  # every row so far holds nothing
        ref_k, ref_v = like if like is not None else (self.keys, self.values)
        parts: list[list[mx.array]] = [[], []]
        for side, (held, ref) in enumerate(((self.keys, ref_k), (self.values, ref_v))):
            b = parts[side]
            if held is not None:
                b.append(self._pad_left(held[..., : self._array_idx, :], self.idx - self._array_idx))
            elif old_rows:
                b.append(mx.zeros((old_rows, ref.shape[1], self.idx, ref.shape[3]), ref.dtype))
            for row in pending:
                a = row[side]
                if a is None:
                    b.append(mx.zeros((1, ref.shape[1], self.idx, ref.shape[3]), ref.dtype))
                else:
                    b.append(self._pad_left(a, self.idx - a.shape[2]))
        self.keys, self.values = (mx.concatenate(b, axis=0) if len(b) > 1 else b[0] for b in parts)

    def remove(self, i: int, trailing: int = 0) -> tuple[mx.array | None, mx.array | None]:
        """Take row ``i`` out; return its keys and values without padding (None if empty),
        copies of its own: a slice would keep the batch's whole buffer alive until the row's
        cache is next evaluated, one buffer per row leaving (16 rows over a 4k prompt held
        4x their KV). ``trailing``: columns at the row's end that are right padding (a
        prefill chunk wider than the row's last tokens), cut off too. The arrays shrink when
        next read: rows leaving in one round take one gather (see ``add``)."""
        if self._pending:
            self._materialize()
        pad = self.left.pop(i)
        self.sees.pop(i)
        rows = self._rows if self._rows is not None else list(range(len(self.left) + 1))
        at = rows.pop(i)
        end = self.idx - trailing
        row_k = row_v = None
        if self.keys is not None and end > pad:
            cols = slice(self._col0 + pad, self._col0 + end)
            row_k = mx.contiguous(self.keys[at : at + 1, :, cols, :])
            row_v = mx.contiguous(self.values[at : at + 1, :, cols, :])
        if not self.left:
            self.keys = self.values = None
            self.idx, self._rows, self._col0 = 0, None, 0
        elif self.keys is not None:
            self._rows = rows
            drop = min(self.left)  # columns that are padding for every row left
            if drop:
                self.left = [pad - drop for pad in self.left]
                self.idx -= drop
                self._col0 += drop
        self._refresh()
        return row_k, row_v

    def _gather_kept(self) -> None:
        """Drop the rows and columns ``remove`` took out since the arrays were last built,
        in one gather."""
        if self._rows is None or self.keys is None:
            self._rows, self._col0 = None, 0
            return
        keep = mx.array(self._rows)
        cols = slice(self._col0, self._col0 + (self._array_idx if self._pending else self.idx))
        self.keys, self.values = self.keys[keep, :, cols], self.values[keep, :, cols]
        self._rows, self._col0 = None, 0

    def trim(self, n: int) -> int:
        """Take back the last ``n`` columns of every row (no more than the columns every row
        holds tokens in): what the last steps wrote; the buffer stays, so the next step
        writes in place. Returns the columns taken back."""
        self._materialize()
        n = max(0, min(n, self.idx - max(self.left, default=0)))
        self.idx -= n
        self._refresh()
        return n

    # -- what the attention layers call ---------------------------------------------

    def make_mask(self, n_queries: int, window: int | None = None) -> Any:
        self._materialize()
        if window is not None:
            raise ValueError("a batch decodes without sliding windows")
        if not any(self.left):  # no padding: as a lone sequence does (the fast kernels' path)
            return None if n_queries == 1 else "causal"
        columns = mx.arange(self.idx + n_queries)[None, :]
        visible = columns >= self._left[:, None]  # [rows, keys]: not left padding
        if n_queries == 1:
            visible = visible[:, None, None, :]
        else:
            queries = mx.arange(self.idx, self.idx + n_queries)[:, None]
            visible = visible[:, None, None, :] & (columns <= queries)[None, None]
        # Additive, in the cache's dtype: a backend without boolean masks (CUDA) would
        # otherwise convert the boolean one again in every layer.
        dtype = self.keys.dtype if self.keys is not None else mx.float32
        return mx.where(visible, mx.array(0, dtype), mx.array(-math.inf, dtype))

    def _columns_used(self) -> int:
        self._materialize()  # rows joined since the last write become one buffer first
        return self.idx

    def _use_columns(self, end: int) -> None:
        self.idx = end

    def attend_with_prefix(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
        """Append ``k``/``v`` and attend ``q`` ([rows, heads, L, dim]) over the prefix (rows
        that see it) then each row's own tokens, under ``mask`` (``make_mask``'s, for the
        rows' own tokens), in slices of queries that keep the scores small."""
        keys, values = self.update_and_fetch(k, v)
        b, n_heads, n_q, _ = q.shape
        span = sum(p[0].shape[2] for p in self.prefixes) + keys.shape[2]
        step = max(1, SCORE_ELEMENTS // max(1, b * n_heads * span))
        if isinstance(mask, str):  # the fast kernel's "causal": the last n_q columns are the queries'
            cols, rows = mx.arange(keys.shape[2]), mx.arange(keys.shape[2] - n_q, keys.shape[2])
            mask = mx.where(cols[None, :] <= rows[:, None], mx.array(0, q.dtype), mx.array(-math.inf, q.dtype))
        outs = []
        for lo in range(0, n_q, step):
            hi = min(n_q, lo + step)
            part = None if mask is None else mask[..., lo:hi, :] if mask.shape[-2] == n_q else mask
            outs.append(self._attention_in_parts(q[:, :, lo:hi], keys, values, scale, part))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _attention_in_parts(self, q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        assert self.prefixes
        b, n_heads, n_q, d = q.shape
        n_kv = keys.shape[1]
        rep = n_heads // n_kv
        qs = (q * scale).reshape(b, n_kv, rep, n_q, d)
        # Every row's queries against each prefix: rows become query columns of one matmul.
        flat = qs.transpose(1, 0, 2, 3, 4).reshape(1, n_kv, b * rep * n_q, d)
        parts = []
        for j, (pk, _) in enumerate(self.prefixes):
            p = pk.shape[2]
            on_prefix = (flat @ pk.swapaxes(-1, -2)).reshape(n_kv, b, rep, n_q, p).transpose(1, 0, 2, 3, 4)
            sees = (self._sees == j)[:, None, None, None, None]
            parts.append(mx.where(sees, on_prefix, mx.array(-math.inf, on_prefix.dtype)))
        on_own = qs @ keys[:, :, None].swapaxes(-1, -2)  # [rows, kv heads, rep, L, own tokens]
        if mask is not None:
            on_own = on_own + (mask[:, :, None] if mask.ndim == 4 else mask).astype(on_own.dtype)
        weights = mx.softmax(mx.concatenate([*parts, on_own], axis=-1).astype(mx.float32), axis=-1)
        weights = weights.astype(values.dtype)
        out, at = None, 0
        for (_, pv), part in zip(self.prefixes, parts, strict=True):
            p = part.shape[-1]
            w_prefix = weights[..., at : at + p].transpose(1, 0, 2, 3, 4).reshape(1, n_kv, b * rep * n_q, p)
            from_prefix = (w_prefix @ pv).reshape(n_kv, b, rep, n_q, d).transpose(1, 0, 2, 3, 4)
            out = from_prefix if out is None else out + from_prefix
            at += p
        out = out + weights[..., at:] @ values[:, :, None]
        return out.reshape(b, n_heads, n_q, d)

    @property
    def state(self) -> tuple[mx.array, ...]:
        self._materialize()
        return () if self.keys is None else (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        """The rows' own keys and values (the prefixes are the pool's blocks, counted there)."""
        self._materialize()
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
