"""gpt-oss's "harmony" format, split into reasoning and answer while it streams.

A harmony reply is a run of messages, each ``<|start|>ROLE<|channel|>NAME ...<|message|>
TEXT`` closed by ``<|end|>`` (more follows), ``<|return|>`` (done) or ``<|call|>`` (a
tool call). The first message's ``<|start|>assistant`` is already in the prompt. The
channel decides where TEXT goes: ``analysis`` is the model's reasoning; ``final`` (the
answer) and ``commentary`` (preambles and tool calls, meant for the user or the tools)
are the answer. Headers and the closing tokens carry no text of their own.

Same interface as ``markers.ReasoningSplitter``: ``feed(piece) -> [(channel, text)]``,
``flush()``; text is held back only while it could still become a control token.
"""

from __future__ import annotations

from engine.text.channels import Channel, add_piece

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CLOSERS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = ("analysis",)
_BODY_TOKENS = (START, CHANNEL, *CLOSERS)


class HarmonySplitter:
    def __init__(self, starts_in_reasoning: bool = False):
        self.channel: Channel = "reasoning" if starts_in_reasoning else "answer"
        self._pending = ""
        self._header: str | None = None  # the header being read, until <|message|>

    def feed(self, piece: str) -> list[tuple[Channel, str]]:
        self._pending += piece
        out: list[tuple[Channel, str]] = []
        while True:
            if self._header is not None:
                end = self._pending.find(MESSAGE)
                if end < 0:
                    # Headers are short; keep only what could still be part of <|message|>.
                    keep = _prefix_tail(self._pending, (MESSAGE,))
                    self._header += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._open(self._header + self._pending[:end])
                self._header = None
                self._pending = self._pending[end + len(MESSAGE) :]
                continue
            hits = [(i, t) for t in _BODY_TOKENS if (i := self._pending.find(t)) >= 0]
            if not hits:
                keep = _prefix_tail(self._pending, _BODY_TOKENS)
                self._emit(out, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            index, token = min(hits)
            self._emit(out, self._pending[:index])
            self._pending = self._pending[index + len(token) :]
            if token in (START, CHANNEL):
                self._header = token
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """The held-back tail at the end of the stream; an unfinished header is dropped."""
        out: list[tuple[Channel, str]] = []
        if self._header is None:
            self._emit(out, self._pending)
        self._pending, self._header = "", None
        return out

    def _open(self, header: str) -> None:
        """A message begins: its channel (the word after <|channel|>) says where it goes."""
        _, _, rest = header.partition(CHANNEL)
        name = rest.split(" ", 1)[0].split("<|", 1)[0].strip()
        self.channel = "reasoning" if name in REASONING_CHANNELS else "answer"

    def _emit(self, out: list[tuple[Channel, str]], text: str) -> None:
        add_piece(out, self.channel, text)


def _prefix_tail(text: str, tokens: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tokens``."""
    for size in range(min(len(text), max(len(t) for t in tokens) - 1), 0, -1):
        tail = text[-size:]
        if any(t.startswith(tail) for t in tokens):
            return size
    return 0
