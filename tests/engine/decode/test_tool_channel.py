"""The tool-call channel: calls leave the answer, every token id still goes out once, in order."""

from __future__ import annotations

import json

from engine.api import GenerationResult, GenerationStats
from engine.decode.loop import Piece
from engine.decode.tool_channel import tool_channel
from engine.text.tool_calls import FORMATS, parse_tool_calls

REPLY = [
    "Let me look",
    " it up. <tool",
    '_call>\n{"name": "lookup", ',
    '"arguments": {"city": "rome"}}',
    "\n</tool_call>",
    " done",
]


def _stream(parts, channel="answer", logprobs=True):
    stats = GenerationStats()
    ids = iter(range(100))
    pieces = []
    for text in parts:
        tokens = [next(ids), next(ids)]
        pieces.append(Piece(text, channel, tokens, stats, [-0.5, -0.25] if logprobs else None))
    result = GenerationResult("".join(parts), "", [t for p in pieces for t in p.token_ids], None, "stop", stats)
    return pieces + [result]


def test_calls_leave_the_answer_and_every_id_goes_out_once_in_order():
    out = list(tool_channel(_stream(REPLY), FORMATS["hermes"]))
    pieces, result = out[:-1], out[-1]
    ids = [t for p in pieces for t in p.token_ids]
    assert ids == list(range(2 * len(REPLY)))
    assert sum(len(p.logprobs) for p in pieces) == len(ids)
    calls = [p.tool_call for p in pieces if p.channel == "tool"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("lookup", {"city": "rome"})]
    answer = "".join(p.text for p in pieces if p.channel == "answer")
    # The referee: the whole reply parsed at once.
    text, whole = parse_tool_calls(FORMATS["hermes"], "".join(REPLY))
    assert answer == result.text == text
    assert [(c.name, c.arguments) for c in result.tool_calls] == [(c.name, c.arguments) for c in whole]


def test_text_held_as_a_possible_marker_goes_out_at_the_end_with_its_ids():
    out = list(tool_channel(_stream(["Hi", " <tool"], logprobs=False), FORMATS["hermes"]))
    pieces, result = out[:-1], out[-1]
    assert [t for p in pieces for t in p.token_ids] == [0, 1, 2, 3]
    assert "".join(p.text for p in pieces) == result.text == "Hi <tool"
    assert result.tool_calls == []


def test_reasoning_passes_and_carries_the_ids_held_before_it():
    stats = GenerationStats()
    items = [
        Piece("<tool", "answer", [0], stats),
        Piece("thinking", "reasoning", [1], stats),
        GenerationResult("<tool", "thinking", [0, 1], None, "stop", stats),
    ]
    out = list(tool_channel(items, FORMATS["hermes"]))
    assert [t for p in out[:-1] for t in p.token_ids] == [0, 1]
    assert out[-1].text == "<tool" and out[-1].reasoning == "thinking"
