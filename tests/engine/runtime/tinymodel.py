"""A tiny causal model and KV cache defined here, so the decode loop can be tested
without any model family: one embedding, one attention layer, an output head."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class ConcatCache:
    """Keys/values grown by concatenation; trimmable, like a plain KV cache."""

    def __init__(self, trimmable: bool = True) -> None:
        self.trimmable = trimmable
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=1)
            self.values = mx.concatenate([self.values, v], axis=1)
        self.offset += k.shape[1]
        return self.keys, self.values

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        if self.keys is not None:
            self.keys = self.keys[:, : self.offset]
            self.values = self.values[:, : self.offset]
        return n


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, seed: int = 0, trimmable: bool = True) -> None:
        super().__init__()
        self.trimmable = trimmable
        mx.random.seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.pos = mx.random.normal((512, dim)) * 0.5
        self.out = nn.Linear(dim, vocab, bias=False)
        self.calls: list[int] = []  # tokens fed per call, to check what was prefilled

    def make_cache(self) -> list[ConcatCache]:
        return [ConcatCache(self.trimmable)]

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        self.calls.append(inputs.shape[1])
        c = cache[0] if cache else ConcatCache()
        start = c.offset
        h = self.embed(inputs) + self.pos[start : start + inputs.shape[1]]
        keys, values = c.update_and_fetch(self.k(h), self.v(h))
        scores = self.q(h) @ keys.transpose(0, 2, 1) / h.shape[-1] ** 0.5
        n, total = inputs.shape[1], keys.shape[1]
        mask = mx.arange(total)[None, :] <= (mx.arange(n) + start)[:, None]
        scores = mx.where(mask, scores, -1e9)
        h = h + mx.softmax(scores, axis=-1) @ values
        return self.out(h) * 4.0


class ByteTokenizer:
    """Token i is the character chr(32 + i); enough to test text handling."""

    eos_token_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) - 32 for ch in text]

    def decode(self, ids) -> str:
        return "".join(chr(32 + i) for i in ids)

    def detokenizer(self):
        tok = self

        class _Detok:
            def add(self, i: int) -> str:
                return tok.decode([i])

            def finalize(self) -> str:
                return ""

        return _Detok()
