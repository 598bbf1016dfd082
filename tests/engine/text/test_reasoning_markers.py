"""Reasoning text is split from the answer, whatever the streaming boundaries."""

from __future__ import annotations

import random
from datetime import datetime

import pytest

from engine.text import chat_template
from engine.text.chat_template import ChatTemplate, load_template
from engine.text.markers import ReasoningMarkers, ReasoningSplitter, detect_reasoning_markers

QWEN_STYLE = "<think>\nLet me add: 2+2=4.\nCheck </thin k>.\n</think>\n\nThe answer is 4. <think is not a tag"
HARMONY = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
)


def run(splitter: ReasoningSplitter, pieces: list[str]) -> list[tuple[str, str]]:
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.flush()
    merged: list[tuple[str, str]] = []
    for channel, text in out:  # pieces of one channel may come in several pairs
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_think_block_is_reasoning():
    assert run(ReasoningSplitter(), [QWEN_STYLE]) == [
        ("reasoning", "Let me add: 2+2=4.\nCheck </thin k>.\n"),
        ("answer", "The answer is 4. <think is not a tag"),
    ]


@pytest.mark.parametrize(
    "text, markers",
    [
        (QWEN_STYLE, ReasoningMarkers("<think>", "</think>")),
        (
            HARMONY,
            ReasoningMarkers(
                "<|channel|>analysis<|message|>", "<|end|>", drop=("<|start|>assistant", "<|channel|>final<|message|>")
            ),
        ),
    ],
)
def test_any_chunking_gives_the_same_split(text, markers):
    expected = run(markers.splitter(), [text])
    assert run(markers.splitter(), list(text)) == expected  # one character at a time
    rng = random.Random(7)
    for _ in range(200):
        assert run(markers.splitter(), random_pieces(text, rng)) == expected


def test_harmony_channels():
    markers = ReasoningMarkers(
        "<|channel|>analysis<|message|>", "<|end|>", drop=("<|start|>assistant", "<|channel|>final<|message|>")
    )
    assert run(markers.splitter(), [HARMONY]) == [("reasoning", "User asks 2+2. Easy."), ("answer", "It is 4.")]


def test_prompt_that_opened_the_block():
    splitter = ReasoningSplitter(starts_in_reasoning=True)
    assert run(splitter, ["\nHmm, ", "four.</th", "ink>\n\n", "4"]) == [("reasoning", "Hmm, four."), ("answer", "4")]


def test_only_possible_tag_prefixes_are_held_back():
    splitter = ReasoningSplitter()
    assert splitter.feed("Hello <") == [("answer", "Hello ")]
    assert splitter.feed("b>bold</b> <th") == [("answer", "<b>bold</b> ")]
    assert splitter.flush() == [("answer", "<th")]  # an unfinished tag at the end is text


def test_several_blocks_and_empty_blocks():
    pieces = ["<think></think>", "A", "<think>x</think>", "B"]
    assert run(ReasoningSplitter(), pieces) == [("answer", "A"), ("reasoning", "x"), ("answer", "B")]


@pytest.fixture
def templates(shared_data, monkeypatch):
    monkeypatch.setattr(chat_template, "clock", lambda: datetime(2025, 3, 14))

    def render(rel: str, **kwargs) -> tuple[str, str]:
        source = load_template(shared_data / "chat_templates" / rel)
        prompt = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(
            [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, **kwargs
        )
        return source, prompt

    return render


def test_detects_deepseek_r1_open_block(templates):
    source, prompt = templates("llama.cpp/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    assert prompt.endswith("<think>\n")
    assert detect_reasoning_markers(source, prompt) == ReasoningMarkers("<think>", "</think>", True)


def test_detects_qwen3_with_and_without_thinking(templates):
    source, prompt = templates("llama.cpp/Qwen-Qwen3-0.6B.jinja")
    assert detect_reasoning_markers(source, prompt) == ReasoningMarkers("<think>", "</think>", False)
    source, prompt = templates("llama.cpp/Qwen-Qwen3-0.6B.jinja", enable_thinking=False)
    assert "<think>\n\n</think>" in prompt
    assert detect_reasoning_markers(source, prompt) == ReasoningMarkers("<think>", "</think>", False)


@pytest.mark.parametrize(
    "rel, open_tag",
    [
        ("llama.cpp/openai-gpt-oss-120b.jinja", "<|channel|>analysis<|message|>"),
        ("llama.cpp/ByteDance-Seed-OSS.jinja", "<seed:think>"),
        ("llama.cpp-2026/google-gemma-4-31B-it.jinja", "<|channel>thought"),
        ("llama.cpp/Qwen-QwQ-32B.jinja", "<think>"),
    ],
)
def test_detects_other_styles(templates, rel, open_tag):
    source, prompt = templates(rel)
    markers = detect_reasoning_markers(source, prompt)
    assert markers is not None and markers.open_tag == open_tag


@pytest.mark.parametrize(
    "rel", ["llama.cpp/microsoft-Phi-3.5-mini-instruct.jinja", "llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja"]
)
def test_no_markers_for_plain_chat_models(templates, rel):
    source, prompt = templates(rel)
    assert detect_reasoning_markers(source, prompt) is None


def test_ministral3_reasoning_marks_think_blocks(templates):
    """Ministral 3 Reasoning writes [THINK]...[/THINK]; its default system prompt shows the
    pair as an example, which must not leave the reply starting in reasoning."""
    source, prompt = templates("llama.cpp-2026/mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    assert "[THINK]" in prompt
    markers = detect_reasoning_markers(source, prompt)
    assert markers == ReasoningMarkers("[THINK]", "[/THINK]", False)
    assert run(markers.splitter(), ["[THINK]Add them.[/THI", "NK]4."]) == [("reasoning", "Add them."), ("answer", "4.")]
