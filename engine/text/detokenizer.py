"""Streaming detokenization: text out as tokens arrive, joining to exactly the full decode.

Decoding token by token does not work: a character may span several byte tokens, a
SentencePiece decoder strips the space of the very first piece only, and byte-fallback
pieces (``<0xE4>``) are turned into text as a run. So each step decodes a short window
that starts at an earlier, already-settled token, and emits what the window's text adds
beyond the settled part. Because the same leading tokens head both decodes, whatever the
decoder does to the start of a string it does to both, and the difference is exact.

Text is held back while it may still change: while it ends in an incomplete character
(U+FFFD) or while a run of byte-fallback pieces is still open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """``add(id)`` returns newly final text; ``finalize()`` returns what was held back.

    Invariant: ``"".join(pieces) + finalize() == tokenizer.decode(ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokens after which text may still change: byte-fallback pieces decode as a run,
        # and a skipped special token lets the runs on either side of it join.
        self._hold_ids = tokenizer.byte_token_ids
        if skip_special_tokens and tokenizer.byte_token_ids:
            self._hold_ids = self._hold_ids | tokenizer.special_token_ids
        self.token_ids: list[int] = []
        self._start = 0  # window start: a settled token whose text is already out
        self._settled_text = ""  # decode(token_ids[_start:_end]), all of it emitted
        self._end = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        if token_id in self._hold_ids:
            return ""  # the run of byte pieces decodes as a whole; wait for its end
        window = self._decode(self.token_ids[self._start:])
        if window.endswith(_REPLACEMENT) or not window.startswith(self._settled_text):
            return ""
        new = window[len(self._settled_text):]
        # Slide the window: it now starts where the previous step ended, provided that
        # stretch decodes to some text. An empty head (a skipped special token, a lone
        # space a decoder strips) would let the decoder treat the next token as the
        # start of the text; keep the older head then.
        head = self._decode(self.token_ids[self._end:])
        if head and window.endswith(head):
            self._start, self._settled_text = self._end, head
        else:
            self._settled_text = window
        self._end = len(self.token_ids)
        self.text += new
        return new

    def finalize(self) -> str:
        """The held-back text (incomplete characters included, as ``decode`` renders them)."""
        window = self._decode(self.token_ids[self._start:])
        if window.startswith(self._settled_text):
            rest = window[len(self._settled_text):]
        else:  # the decoder rewrote settled text; fall back to a full decode once
            full = self._decode(self.token_ids)
            rest = full[len(self.text):]
        self._start, self._end = len(self.token_ids), len(self.token_ids)
        self._settled_text = ""
        self.text += rest
        return rest
