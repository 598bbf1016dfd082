"""Tool calls round-trip through each family's real chat template: the template renders an
assistant turn that calls a tool, and the parser reads the same call back from the text the
model would have written (the rendered turn after the generation prompt)."""

from __future__ import annotations

import json

import pytest

from engine.text.chat_template import ChatTemplate
from engine.text.tool_calls import (
    FORMATS,
    ToolCall,
    detect_tool_format,
    parse_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Paris", "days": 3}
END_OF_TURN = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "</s>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<｜end▁of▁sentence｜>",
    "<|im_end|>",
    "<turn|>",
    "<|user|>",
    "<|observation|>",
    "<|tool_response>",
)

# (template file under chat_templates/, the format it should be detected as)
TEMPLATES = [
    ("llama.cpp/Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("llama.cpp/Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("llama.cpp/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("llama.cpp-2026/Qwen3-Coder.jinja", "hermes"),
    ("llama.cpp-2026/GLM-4.6.jinja", "hermes"),
    ("llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("llama.cpp/meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("llama.cpp/meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"),
    ("llama.cpp/mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("llama.cpp/Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
    ("llama.cpp-2026/mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral"),
    ("llama.cpp/openai-gpt-oss-120b.jinja", "harmony"),
    ("llama.cpp/deepseek-ai-DeepSeek-V3.1.jinja", "deepseek"),
    ("llama.cpp-2026/deepseek-ai-DeepSeek-V3.2.jinja", "dsml"),
    ("llama.cpp/moonshotai-Kimi-K2.jinja", "kimi"),
    ("llama.cpp-2026/google-gemma-4-31B-it.jinja", "gemma4"),
]


def _assistant_turn(fmt, args):
    arguments = json.dumps(args) if fmt.arguments_as_text else args
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def _generated_text(source: str, fmt) -> str:
    """What the model writes for the call: the rendered turn after the generation prompt."""
    template = ChatTemplate(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    prompt = template.render(user, tools=TOOLS, add_generation_prompt=True)
    full = template.render(user + [_assistant_turn(fmt, ARGS)], tools=TOOLS)
    if full.startswith(prompt):
        text = full[len(prompt) :]
    else:  # the generation prompt differs from a past turn's header (Gemma 4's empty thought)
        common = 0
        while common < min(len(prompt), len(full)) and prompt[common] == full[common]:
            common += 1
        text = full[full.rfind("\n", 0, common) + 1 :]
    text = text.rstrip()
    # The turn's end-of-turn token ends generation and never reaches the text.
    for end in END_OF_TURN:
        text = text.removesuffix(end).rstrip()
    return text


@pytest.mark.parametrize(("name", "expected"), TEMPLATES, ids=[t[0].split("/")[-1] for t in TEMPLATES])
def test_a_call_round_trips_through_the_real_template(shared_data, name, expected):
    path = shared_data / "chat_templates" / name
    source = path.read_text(encoding="utf-8")
    fmt = detect_tool_format(source)
    assert fmt is not None and fmt.name == expected
    text = _generated_text(source, fmt)
    _, calls = parse_tool_calls(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)], text
    # Streamed one character at a time, the parser finds the same call.
    parser = fmt.parser()
    items = [i for ch in text for i in parser.feed(ch)] + parser.flush()
    streamed = [i for i in items if isinstance(i, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [("get_weather", ARGS)]
    assert "get_weather" not in "".join(i for i in items if isinstance(i, str))


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"</tool_call> done'),
        ("hermes", "<tool_call>get weather please</tool_call>"),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": '),
        ("llama3", '{"answer": 42}'),
        ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{oops"),
    ],
)
def test_a_malformed_call_comes_back_as_the_text_it_was(fmt, text):
    parser = FORMATS[fmt].parser()
    items = [i for ch in text for i in parser.feed(ch)] + parser.flush()
    assert items and all(isinstance(i, str) for i in items)
    assert "".join(items) == text


def test_text_around_calls_streams_and_keeps_its_order():
    text = (
        'Let me check.<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>'
    )
    parser = FORMATS["hermes"].parser()
    first = parser.feed(text[:20])
    assert first == ["Let me check."]  # the held-back "<tool_" is not text yet
    items = first + parser.feed(text[20:]) + parser.flush()
    kinds = [i if isinstance(i, str) else (i.name, json.loads(i.arguments)) for i in items]
    assert kinds == ["Let me check.", ("a", {}), "\n", ("b", {"x": [1, 2]})]
    ids = [i.id for i in items if isinstance(i, ToolCall)]
    assert len(set(ids)) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_plain_replies_are_not_mistaken_for_calls():
    assert detect_tool_format("{{ messages }}") is None
    text, calls = parse_tool_calls(FORMATS["llama3"], "The weather is {sunny} today.")
    assert (text, calls) == ("The weather is {sunny} today.", [])
