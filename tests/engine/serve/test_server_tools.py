"""Tool calls through the server: the model (a tiny random one, steered by a regex so it
writes a call in Qwen's own markers) calls a tool, the clients get OpenAI tool_calls /
Anthropic tool_use blocks, and the call and its result go back in through Qwen 2.5's real
chat template."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.tiny_models import make_tiny_llama

from .conftest import start_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
MALFORMED = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": \n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_server(shared_data, tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny-qwen")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (shared_data / "chat_templates/llama.cpp/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    srv = start_server(folder, tmp_path_factory.mktemp("tools-log") / "server.log")
    yield srv
    srv.stop()


def _regex(pattern):
    return {"response_format": {"type": "regex", "pattern": pattern}}


@pytest.fixture
def client(qwen_server):
    with openai.OpenAI(base_url=qwen_server.v1, api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_openai_tool_calls_whole_and_streamed_and_back_in(client):
    kw = {
        "model": "tiny-qwen",
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 150,
        "temperature": 0,
        "extra_body": _regex(CALL),
    }
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}

    # The call and its result go back in, rendered by the template's own tool turns.
    follow = client.chat.completions.create(
        model="tiny-qwen",
        tools=TOOLS,
        max_tokens=5,
        temperature=0,
        messages=ASK
        + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ],
    )
    assert follow.choices[0].message.content is not None


def test_a_malformed_call_is_returned_as_text(client):
    r = client.chat.completions.create(
        model="tiny-qwen", messages=ASK, tools=TOOLS, max_tokens=150, temperature=0, extra_body=_regex(MALFORMED)
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.startswith('<tool_call>\n{"name": "get_weather"')


def test_anthropic_tool_use_whole_and_streamed(qwen_server):
    with anthropic.Anthropic(base_url=qwen_server.base, api_key="none", max_retries=0, timeout=120) as client:
        _anthropic_tool_round(client)


def _anthropic_tool_round(client):
    tools = [
        {"name": "get_weather", "description": "Weather in a city", "input_schema": TOOLS[0]["function"]["parameters"]}
    ]
    kw = {
        "model": "tiny-qwen",
        "max_tokens": 150,
        "messages": ASK,
        "tools": tools,
        "extra_body": {"temperature": 0, "output_config": {"format": {"type": "regex", "pattern": CALL}}},
    }
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use"
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    follow = client.messages.create(
        model="tiny-qwen",
        max_tokens=5,
        tools=tools,
        extra_body={"temperature": 0},
        messages=ASK
        + [
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
        ],
    )
    assert follow.role == "assistant"


FORCED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
        },
    },
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_forces_a_valid_call(client, choice):
    import jsonschema

    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny-qwen",
            messages=ASK,
            tools=FORCED_TOOLS,
            tool_choice=choice,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
        (call,) = r.choices[0].message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        tool = next(t for t in FORCED_TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_anthropic_tool_choice_names_a_tool(qwen_server):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in FORCED_TOOLS]
    with anthropic.Anthropic(base_url=qwen_server.base, api_key="none", max_retries=0, timeout=120) as client:
        r = client.messages.create(
            model="tiny-qwen",
            max_tokens=200,
            messages=ASK,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_time"},
        )
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET")
