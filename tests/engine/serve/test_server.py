"""The server through the official OpenAI and Anthropic clients, against the real CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import anthropic
import openai
import pytest

from .conftest import API_KEY, ROOT, post_raw

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def _chat(client, model_id, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model_id, **kw)


def test_models_lists_the_loaded_model(client, model_id):
    assert model_id == "tiny-chat"


def test_chat_streams_what_it_answers_whole(client, model_id):
    whole = _chat(client, model_id)
    assert whole.choices[0].finish_reason in ("stop", "length")
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(_chat(client, model_id, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The same conversation again: its prompt comes from the cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 1


def test_stop_strings_cut_the_reply(client, model_id):
    text = _chat(client, model_id, max_tokens=20).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = _chat(client, model_id, max_tokens=20, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_seed_reproduces_sampling_and_max_completion_tokens_bounds_it(client, model_id):
    a = _chat(client, model_id, temperature=1.0, top_p=0.9, seed=7, max_tokens=None, max_completion_tokens=9)
    b = _chat(client, model_id, temperature=1.0, top_p=0.9, seed=7, max_tokens=None, max_completion_tokens=9)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 9


def test_logprobs_and_top_logprobs(client, model_id):
    r = _chat(client, model_id, logprobs=True, top_logprobs=3, max_tokens=6)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and all(v <= 0 for v in tops)
        # Greedy: the chosen token is the most likely one.
        assert e.logprob == pytest.approx(max(tops), abs=1e-5)
    # Streamed, each chunk carries its own tokens' log-probs: together, the same list.
    chunks = list(_chat(client, model_id, logprobs=True, top_logprobs=3, max_tokens=6, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs) > 1


def test_completions_continue_plain_text(client, model_id):
    r = client.completions.create(model=model_id, prompt="the quick brown", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id, prompt="the quick brown", max_tokens=5, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_anthropic_messages_stream_and_not(server, client, model_id):
    with anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120) as ac:
        _anthropic_round(ac, model_id)


def _anthropic_round(ac, model_id):
    whole = ac.messages.create(
        model=model_id,
        max_tokens=10,
        extra_body={"temperature": 0},
        system="Be brief.",
        messages=[{"role": "user", "content": "hello there"}],
    )
    assert whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert text and whole.usage.output_tokens > 0
    with ac.messages.stream(
        model=model_id,
        max_tokens=10,
        extra_body={"temperature": 0},
        system="Be brief.",
        messages=[{"role": "user", "content": "hello there"}],
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again


def test_json_schema_output_validates(client, model_id):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    for seed in range(3):
        r = _chat(
            client,
            model_id,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"
    r = _chat(client, model_id, temperature=1.0, seed=2, max_tokens=200, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_errors_have_openai_bodies(server, client, model_id):
    with (
        pytest.raises(openai.AuthenticationError),
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0) as wrong,
    ):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model_id, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        _chat(client, model_id, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.APIStatusError) as e:  # the server takes 64 KiB at most here
        _chat(client, model_id, messages=[{"role": "user", "content": "x" * 100_000}])
    assert e.value.status_code == 413
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    status, body = post_raw(server.v1 + "/chat/completions", b"{not json", headers)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post_raw(server.v1 + "/chat/completions", b"{}", {**headers, "Content-Type": "text/plain"})
    assert status == 415
    with (
        pytest.raises(anthropic.NotFoundError),
        anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0) as ac,
    ):
        ac.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:  # a text model refuses images, saying so
        _chat(
            client,
            model_id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    ],
                }
            ],
        )
    assert "image" in e.value.body["message"]


def test_no_cors_and_loopback_host_only(server):
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(server.base + "/health") as r:
        assert not any(h.lower().startswith("access-control") for h in r.headers)
    req = urllib.request.Request(server.base + "/health", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    e.value.close()
    assert e.value.code == 403


def test_concurrent_requests_queue_and_each_gets_its_own_answer(client, model_id):
    prompts = ["hello there", "the quick brown fox", "what is the capital", "write a story"]
    alone = [
        _chat(client, model_id, messages=[{"role": "user", "content": p}]).choices[0].message.content for p in prompts
    ]
    together: list[str | None] = [None] * len(prompts)

    def ask(i: int) -> None:
        together[i] = (
            _chat(client, model_id, messages=[{"role": "user", "content": prompts[i]}], stream=bool(i % 2))
            .choices[0]
            .message.content
            if i % 2 == 0
            else "".join(
                c.choices[0].delta.content or ""
                for c in _chat(client, model_id, messages=[{"role": "user", "content": prompts[i]}], stream=True)
            )
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(server, client, model_id, stream):
    body = json.dumps(
        {"model": model_id, "messages": HELLO, "max_tokens": 100_000, "temperature": 0, "stream": stream}
    ).encode()
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        else:
            time.sleep(1.0)
    # 100,000 tokens would take minutes; once cancelled, the worker answers the next at once.
    start = time.monotonic()
    assert _chat(client, model_id, max_tokens=3).choices[0].message.content is not None
    assert time.monotonic() - start < 20


def test_other_addresses_need_a_key(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", str(tiny_model), "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "--api-key" in proc.stderr


def test_two_conversations_keep_their_own_cached_prefix(client, model_id):
    a = [{"role": "system", "content": "You are A."}, {"role": "user", "content": "the quick brown fox"}]
    b = [{"role": "system", "content": "You are B."}, {"role": "user", "content": "what is the capital"}]
    first_a = _chat(client, model_id, messages=a, max_tokens=4)
    _chat(client, model_id, messages=b, max_tokens=4)
    # A's next turn resends its history: all of it up to the new message comes from A's cache,
    # although B ran in between.
    turn = a + [
        {"role": "assistant", "content": first_a.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    again = _chat(client, model_id, messages=turn, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens >= first_a.usage.prompt_tokens
