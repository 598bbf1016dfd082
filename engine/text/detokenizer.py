"""Streaming detokenization: text out as tokens arrive, joining to exactly the full decode.

Decoding token by token does not work: a character may span several byte tokens, a
SentencePiece decoder strips the space of the very first piece only, and byte-fallback
pieces (``<0xE4>``) are turned into text as a run. So each step decodes a short window
that starts at an earlier, already-settled token, and emits what the window's text adds
beyond the settled part. Because the same leading tokens head both decodes, whatever the
decoder does to the start of a string it does to both, and the difference is exact.

Text is held back while it may still change: while it ends in an incomplete character
(U+FFFD) or while a run of byte-fallback pieces is still open.

When the tokenizer cleans up tokenization spaces, the windows decode without it and the
raw text passes through ``StreamingCleanup``, which also holds back a tail that later
text may still clean (a trailing space may be dropped before a ".").
"""

from __future__ import annotations

from typing import Protocol

from engine.text.cleanup import StreamingCleanup


class DecodingVocabulary(Protocol):
    """What the detokenizer needs of a tokenizer (engine.text.tokenizer.Tokenizer has it)."""

    byte_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    clean_up_tokenization_spaces: bool

    def decode(
        self, ids: list[int], *, skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """``add(id)`` returns newly final text; ``finalize()`` returns what was held back.

    Invariant: ``"".join(pieces) + finalize() == tokenizer.decode(ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: DecodingVocabulary, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokens after which text may still change: byte-fallback pieces decode as a run,
        # and a skipped special token lets the runs on either side of it join.
        self._hold_ids = tokenizer.byte_token_ids
        if skip_special_tokens and tokenizer.byte_token_ids:
            self._hold_ids = self._hold_ids | tokenizer.special_token_ids
        self.token_ids: list[int] = []
        self.window_start = 0  # window start: a settled token whose text is already out
        self._settled_text = ""  # decode(token_ids[_start:_end]), all of it emitted
        self._end = 0
        self._raw_text = ""  # the same, before the cleanup
        self.text = ""  # everything emitted so far
        self._cleanup = StreamingCleanup() if tokenizer.clean_up_tokenization_spaces else None

    def _decode(self, ids: list[int]) -> str:
        # Raw text: the cleanup runs on the joined stream, not on each window.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        new = self._add_raw(token_id)
        if self._cleanup is not None:
            new = self._cleanup.push(new)
        self.text += new
        return new

    def finalize(self) -> str:
        """The held-back text (incomplete characters included, as ``decode`` renders them)."""
        rest = self._finalize_raw()
        if self._cleanup is not None:
            rest = self._cleanup.push(rest) + self._cleanup.flush()
        self.text += rest
        return rest

    def _add_raw(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        if token_id in self._hold_ids:
            return ""  # the run of byte pieces decodes as a whole; wait for its end
        window = self._decode(self.token_ids[self.window_start :])
        if window.endswith(_REPLACEMENT) or not window.startswith(self._settled_text):
            return ""
        new = window[len(self._settled_text) :]
        # Slide the window to start at the newest token, or failing that at the first
        # token this step emitted. A head must decode to some text on its own and end
        # the window's text: an empty head (a skipped special token, a lone space a
        # decoder strips) would let the decoder treat the next token as the start of
        # the text, and a head that starts inside a character decodes differently.
        for start in dict.fromkeys((len(self.token_ids) - 1, self._end)):
            head = self._decode(self.token_ids[start:])
            if head and window.endswith(head):
                self.window_start, self._settled_text = start, head
                break
        else:
            self._settled_text = window
        self._end = len(self.token_ids)
        self._raw_text += new
        return new

    def _finalize_raw(self) -> str:
        window = self._decode(self.token_ids[self.window_start :])
        if window.startswith(self._settled_text):
            rest = window[len(self._settled_text) :]
        else:  # the decoder rewrote settled text; fall back to a full decode once
            full = self._decode(self.token_ids)
            rest = full[len(self._raw_text) :]
        self.window_start, self._end = len(self.token_ids), len(self.token_ids)
        self._settled_text = ""
        self._raw_text += rest
        return rest
