"""The tool-call channel: with tools offered, a reply's calls leave its answer text.

``tool_channel`` wraps a reply's stream (``Piece`` items, then its ``GenerationResult``;
batch signals and diffusion drafts pass as they are). The answer channel's text goes
through the model's ``ToolCallParser`` (engine.text.tool_calls), whose format the load
found in the chat template once: text outside calls stays on "answer", and each call
becomes a piece on the "tool" channel carrying the ``ToolCall`` (its text empty). Text the
parser holds back (it may begin a call) goes out later, and the token ids and log-probs of
the pieces it came in ride on the next piece that goes out, so every generated token is
still carried by exactly one piece, in order. The result's ``text`` is the answer without
the calls' markers and ``tool_calls`` the calls; a block that does not parse stays text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from engine.api import GenerationResult, ToolCall
from engine.decode.loop import Piece
from engine.text.tool_calls import ToolCallFormat


def tool_channel(stream: Iterable[Any], fmt: ToolCallFormat) -> Iterator[Any]:
    """``stream`` with its answer's calls on the "tool" channel (see the module's docstring)."""
    parser = fmt.parser()
    held: list[Piece] = []  # pieces whose ids have not gone out yet
    answer: list[str] = []
    calls: list[ToolCall] = []
    latest: Piece | None = None  # the last piece in: its stats stand for the reply's now

    def release(items: list[str | ToolCall]) -> Iterator[Piece]:
        assert latest is not None
        for item in items:
            if isinstance(item, ToolCall):
                calls.append(item)
                yield _carrying(held, "", "tool", latest, item)
            elif item:
                answer.append(item)
                yield _carrying(held, item, "answer", latest)
            held.clear()

    for item in stream:
        if isinstance(item, Piece):
            latest = item
            held.append(item)
            if item.channel == "answer":
                yield from release(parser.feed(item.text))
            else:  # reasoning: the ids held before it go out with it
                yield _carrying(held, item.text, item.channel, item)
                held.clear()
        elif isinstance(item, GenerationResult):
            if latest is not None:
                yield from release(parser.flush())
                if held:  # ids whose text never became anything (a held marker that ended the reply)
                    yield _carrying(held, "", "answer", latest)
                    held.clear()
            item.text = "".join(answer)
            item.tool_calls = list(calls)
            yield item
        else:
            yield item


def _carrying(held: list[Piece], text: str, channel: Any, latest: Piece, call: ToolCall | None = None) -> Piece:
    """A piece with ``text`` (or ``call``) carrying every id of the ``held`` pieces, with
    the ``latest`` piece's stats."""
    logprobs = None if latest.logprobs is None else [lp for p in held for lp in p.logprobs or []]
    tops = None if latest.top_logprobs is None else [row for p in held for row in p.top_logprobs or []]
    return Piece(text, channel, [t for p in held for t in p.token_ids], latest.stats, logprobs, tops, call)
