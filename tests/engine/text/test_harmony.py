"""gpt-oss's harmony replies: the analysis channel is reasoning, final and commentary are
the answer, headers and closing tokens vanish, whatever the streaming boundaries. With
the real gpt-oss chat template: the effort switch reaches the prompt, and ids streamed
through a real BPE detokenizer split the same as the text."""

from __future__ import annotations

import json
import random
from datetime import datetime

import pytest

from engine.text import chat_template
from engine.text.chat_template import ChatTemplate, load_template
from engine.text.harmony import HarmonySplitter
from engine.text.markers import detect_reasoning_markers
from engine.text.reasoning_switch import find_reasoning_control, reasoning_variables
from engine.text.tokenizer import Tokenizer

TEMPLATE = "llama.cpp/openai-gpt-oss-120b.jinja"
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# A reply as gpt-oss writes it after the prompt's "<|start|>assistant": reasoning, a
# preamble for the user, a tool call, then (after the tool's answer) more reasoning and
# the final answer.
REPLY = (
    "<|channel|>analysis<|message|>User wants weather. Need tool.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Oslo"}<|call|>'
    "<|start|>assistant<|channel|>analysis<|message|>It is 4°C.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It's 4 °C in Oslo <|and|> windy.<|return|>"
)
EXPECTED = [
    ("reasoning", "User wants weather. Need tool."),
    ("answer", 'Checking the forecast.{"city":"Oslo"}'),
    ("reasoning", "It is 4°C."),
    ("answer", "It's 4 °C in Oslo <|and|> windy."),
]


def run(splitter, pieces: list[str]) -> list[tuple[str, str]]:
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    return merge(out + splitter.flush())


def merge(out: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive pieces of one channel joined (a stream may deliver them in many pairs)."""
    merged: list[tuple[str, str]] = []
    for channel, text in out:
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


def test_channels_split_into_reasoning_and_answer():
    assert run(HarmonySplitter(), [REPLY]) == EXPECTED


def test_any_chunking_gives_the_same_split():
    assert run(HarmonySplitter(), list(REPLY)) == EXPECTED
    rng = random.Random(3)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(REPLY)), k=rng.randint(1, 30)))
        pieces = [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)])]
        assert run(HarmonySplitter(), pieces) == EXPECTED


def test_text_that_only_looks_like_a_token_is_held_then_released():
    splitter = HarmonySplitter()
    assert splitter.feed("<|channel|>final<|message|>a <|") == [("answer", "a ")]
    assert splitter.feed("b") == [("answer", "<|b")]
    assert splitter.flush() == []


def test_a_prompt_that_opened_the_analysis_channel_starts_in_reasoning():
    assert run(HarmonySplitter(starts_in_reasoning=True), ["thinking", "<|end|>"]) == [("reasoning", "thinking")]


def test_an_unfinished_header_at_the_end_is_dropped():
    assert run(HarmonySplitter(), ["<|channel|>final<|message|>done<|end|><|start|>assis"]) == [("answer", "done")]


@pytest.fixture
def gpt_oss(shared_data, monkeypatch):
    monkeypatch.setattr(chat_template, "clock", lambda: datetime(2025, 8, 5))
    source = load_template(shared_data / "chat_templates" / TEMPLATE)
    return ChatTemplate(source, {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"})


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_effort_switch_reaches_the_prompt_and_the_reply_splits(gpt_oss, effort):
    control = find_reasoning_control(gpt_oss)
    assert control.variable == "reasoning_effort" and control.choices == ("low", "medium", "high")
    assert control.default == "medium"
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = gpt_oss.render(messages, add_generation_prompt=True, **reasoning_variables(control, effort))
    assert f"Reasoning: {effort}" in prompt and prompt.endswith("<|start|>assistant")
    splitter = detect_reasoning_markers(gpt_oss.source, prompt).splitter()
    assert isinstance(splitter, HarmonySplitter) and splitter.channel == "answer"
    assert run(splitter, [REPLY]) == EXPECTED


def test_earlier_turns_do_not_leave_the_reply_in_reasoning(gpt_oss):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "Simple sum."},
        {"role": "user", "content": "And 3+3?"},
    ]
    prompt = gpt_oss.render(messages, add_generation_prompt=True)
    assert "<|channel|>final<|message|>4" in prompt
    assert detect_reasoning_markers(gpt_oss.source, prompt).splitter().channel == "answer"


def test_ids_streamed_through_a_real_detokenizer_split_the_same(shared_data, tmp_path):
    """gpt-2's BPE with harmony's control tokens added as special tokens (as o200k_harmony
    has them): the decoded stream keeps them, so the splitter sees every header."""
    data = json.loads((shared_data / "tokenizers" / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = len(data["model"]["vocab"])
    data["added_tokens"] = [
        *data.get("added_tokens", []),
        *(
            {
                "id": next_id + i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(HARMONY_SPECIALS)
        ),
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}), encoding="utf-8")
    tokenizer = Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert next_id + HARMONY_SPECIALS.index("<|channel|>") in ids
    detok, splitter, out = tokenizer.detokenizer(), HarmonySplitter(), []
    for token in ids[:-1]:  # the last, <|return|>, ends the sequence: generation stops there
        out += splitter.feed(detok.add(token))
    out += splitter.feed(detok.finalize()) + splitter.flush()
    assert merge(out) == EXPECTED
