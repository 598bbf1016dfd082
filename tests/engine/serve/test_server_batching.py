"""Continuous batching over HTTP: the official client's requests decode together, a short
request finishes while a long one streams, and a client that disconnects takes only its
own sequence out of the batch."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import openai
import pytest

from .conftest import API_KEY

PROMPT = [{"role": "user", "content": "write a story"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def decoding(server) -> int:
    with urllib.request.urlopen(server.base + "/health", timeout=10) as r:
        return json.loads(r.read())["decoding"]


def stream_text(client, model_id, messages, max_tokens, seen: threading.Event | None = None) -> tuple[str, str]:
    parts, finish = [], ""
    for chunk in client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            if seen is not None and parts[-1]:
                seen.set()
    return "".join(parts), finish


def test_a_short_request_finishes_while_a_long_one_streams(server, client, model_id):
    alone, _ = stream_text(client, model_id, PROMPT, 300)
    long_result: list = []
    started = threading.Event()
    t = threading.Thread(target=lambda: long_result.append(stream_text(client, model_id, PROMPT, 300, started)))
    t.start()
    assert started.wait(60)
    short = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0
    )
    assert short.choices[0].message.content is not None
    still_running = t.is_alive()
    t.join(120)
    assert still_running, "the short request waited for the long one"
    assert long_result[0][0] == alone


def test_a_client_that_disconnects_leaves_the_others_decoding(server, client, model_id):
    alone = stream_text(client, model_id, PROMPT, 400)
    kept: list = []
    started = threading.Event()
    t = threading.Thread(target=lambda: kept.append(stream_text(client, model_id, PROMPT, 400, started)))
    t.start()
    assert started.wait(60)
    body = json.dumps(
        {
            "model": model_id,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 100_000,
            "temperature": 0,
            "stream": True,
        }
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
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 30
        while decoding(server) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoding(server) == 2 and t.is_alive()
    # The 100,000-token request goes at once; the other one carries on to its end.
    deadline = time.monotonic() + 30
    while decoding(server) > 1 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled_while_other_ran = t.is_alive() and decoding(server) <= 1
    t.join(120)
    assert cancelled_while_other_ran
    assert kept[0] == alone
    assert decoding(server) == 0
