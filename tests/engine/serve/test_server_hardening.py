"""Requests that must not stop the server: each class of bad input is sent on loopback, gets
a clean 4xx in the API's JSON error shape, and afterwards the server is up and gives the
same greedy answer as before. Also HTTP that clients rely on: keep-alive survives errors,
the listen backlog holds a burst of 200 connections, a short body times out."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from engine.serve.backend import Backend
from engine.serve.server import make_server

from .conftest import API_KEY, start_server

AUTH = f"Authorization: Bearer {API_KEY}\r\n"
GREEDY = {"model": "tiny-chat", "prompt": "the quick brown", "max_tokens": 8, "temperature": 0}


def _port(server) -> int:
    return int(server.base.rsplit(":", 1)[1])


def _exchange(port: int, raw: bytes, timeout: float = 30) -> list[tuple[int, dict]]:
    """Send ``raw`` on one connection; every response read back until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        out.append((status, json.loads(rest[:length])))
        data = rest[length:]
    return out


def _post(path: str, body: dict | bytes, *, extra: str = "", host: str = "127.0.0.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{AUTH}Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + data


def _greedy(server) -> str:
    [(status, body)] = _exchange(_port(server), _post("/v1/completions", GREEDY))
    assert status == 200, body
    return body["choices"][0]["text"]


def _chat(content: str) -> dict:
    return {"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


BAD_BODIES = {
    # token ids outside the 300-token vocabulary, in every spelling that once got through
    "id at vocab": ("/v1/completions", {**GREEDY, "prompt": [300]}),
    "id 10**9": ("/v1/completions", {**GREEDY, "prompt": [10**9]}),
    "id 2**64": ("/v1/completions", {**GREEDY, "prompt": [2**64]}),
    "negative id": ("/v1/completions", {**GREEDY, "prompt": [5, -1]}),
    "bool id": ("/v1/completions", {**GREEDY, "prompt": [True]}),
    "ids in a batch": ("/v1/completions", {**GREEDY, "prompt": [[5, 6], [7, 10**9]]}),
    "echo of bad ids": ("/v1/completions", {**GREEDY, "prompt": [10**9], "echo": True, "max_tokens": 0}),
    "scored bad ids": ("/v1/completions", {**GREEDY, "prompt": [10**9], "echo": True, "logprobs": 1}),
    # lone surrogates in every kind of text field
    "surrogate prompt": ("/v1/completions", b'{"model": "tiny-chat", "prompt": "a\\ud800b"}'),
    "surrogate chat": (
        "/v1/chat/completions",
        b'{"model":"tiny-chat","messages":[{"role":"user","content":"\\udfff"}]}',
    ),
    "surrogate stop": (
        "/v1/chat/completions",
        b'{"model":"tiny-chat","messages":[{"role":"user","content":"hi"}],"stop":"\\ud800"}',
    ),
    "surrogate messages": (
        "/v1/messages",
        b'{"model":"tiny-chat","max_tokens":2,"messages":[{"role":"user","content":"\\ud800"}]}',
    ),
    "surrogate key": ("/v1/completions", b'{"model":"tiny-chat","prompt":"hi","\\ud800":1}'),
    # fields with the wrong range or type
    "NaN": ("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi", "temperature": NaN}'),
    "Infinity": (
        "/v1/chat/completions",
        b'{"model":"tiny-chat","messages":[{"role":"user","content":"hi"}],"top_p":-Infinity}',
    ),
    "seed 2**64": ("/v1/completions", {**GREEDY, "seed": 2**64}),
    "max_tokens 1e400": ("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1e400}'),
    "n zero": ("/v1/completions", {**GREEDY, "n": 0}),
    "n huge": ("/v1/chat/completions", {**_chat("hi"), "n": 10**6}),
    "negative max_tokens": ("/v1/completions", {**GREEDY, "max_tokens": -1}),
    "top logprobs 10**9": ("/v1/completions", {**GREEDY, "logprobs": 10**9}),
    "too many prompts": ("/v1/completions", {**GREEDY, "prompt": ["a"] * 300}),
    # text that cannot fit the 2,048-token context, refused before it is tokenized
    "too long text": ("/v1/chat/completions", _chat("hello " * 10_000)),
    "too long anthropic": ("/v1/messages", _chat("hello " * 10_000)),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_bodies_are_4xx_and_the_server_stays(server, name):
    before = _greedy(server)
    path, body = BAD_BODIES[name]
    [(status, answer)] = _exchange(_port(server), _post(path, body))
    assert 400 <= status < 500, (status, answer)
    error = answer["error"]
    message = error["message"]
    assert message and "\n" not in message and "internal" not in message.lower()
    assert _greedy(server) == before


def test_token_ids_are_named_with_the_vocabulary(server):
    [(status, answer)] = _exchange(_port(server), _post("/v1/completions", {**GREEDY, "prompt": [10**9]}))
    assert status == 400
    assert answer["error"]["message"] == "Token id 1000000000 is outside this model's vocabulary (0 to 299)."
    [(status, _)] = _exchange(_port(server), _post("/v1/completions", {**GREEDY, "prompt": [299]}))
    assert status == 200  # the last row is a token


def _raw(request_line: str, *headers: str) -> bytes:
    return (request_line + "\r\n" + "".join(h + "\r\n" for h in headers) + "Connection: close\r\n\r\n").encode()


RAW_REQUESTS = {
    "userinfo host": (_raw("GET /v1/models HTTP/1.1", "Host: localhost:80@evil.com", AUTH.strip()), 403),
    "path in host": (_raw("GET /v1/models HTTP/1.1", "Host: 127.0.0.1/x", AUTH.strip()), 403),
    "two hosts": (_raw("GET /v1/models HTTP/1.1", "Host: localhost", "Host: evil.com", AUTH.strip()), 400),
    "absolute uri": (_raw("GET http://evil.com/v1/models HTTP/1.1", "Host: localhost", AUTH.strip()), 400),
    "asterisk": (_raw("OPTIONS * HTTP/1.1", "Host: localhost"), 400),
    "unknown method": (_raw("BREW /v1/models HTTP/1.1", "Host: localhost"), 405),
    "trace": (_raw("TRACE /health HTTP/1.1", "Host: localhost"), 405),
    "head": (_raw("HEAD /nowhere HTTP/1.1", "Host: localhost"), 404),
    "bad request line": (b"GARBAGE\r\n\r\n", None),
    "negative length": (
        _post("/v1/completions", b"{}", extra="Content-Length: -5\r\n").replace(b"Content-Length: 2\r\n", b""),
        400,
    ),
    "two lengths": (_post("/v1/completions", b"{}", extra="Content-Length: 9\r\n"), 400),
    "chunked": (_post("/v1/completions", b"{}", extra="Transfer-Encoding: chunked\r\n"), 411),
}


@pytest.mark.parametrize("name", list(RAW_REQUESTS))
def test_malformed_http_is_a_clean_4xx(server, name):
    before = _greedy(server)
    raw, expected = RAW_REQUESTS[name]
    if expected is None:  # not even HTTP: the standard library answers without a status line; only the server matters
        with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as s:
            s.sendall(raw)
            assert b'"error"' in s.recv(65536)
    else:
        responses = _exchange(_port(server), raw)
        assert [status for status, _ in responses] == [expected]
        assert responses[0][1]["error"]["message"]
    assert _greedy(server) == before


def test_keep_alive_survives_errors(server):
    """Errors answered before the body was read (404, 405, 401, 403, 415) leave the
    connection usable: the next request on it gets its own answer."""
    get_health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    body = b'{"model": "tiny-chat"}'
    length = f"Content-Length: {len(body)}\r\n".encode()
    errors = [
        b"POST /nowhere HTTP/1.1\r\nHost: localhost\r\n" + length + b"\r\n" + body,  # 404
        b"DELETE /v1/models HTTP/1.1\r\nHost: localhost\r\n" + length + b"\r\n" + body,  # 405
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + length + b"\r\n" + body,  # 401: no key
        b"POST /v1/completions HTTP/1.1\r\nHost: evil.com\r\n" + length + b"\r\n" + body,  # 403
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + AUTH.encode() + length + b"\r\n" + body,  # 415
        b"PATCH /v1/models HTTP/1.1\r\nHost: localhost\r\n" + length + b"\r\n" + body,  # 405
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + length + b"\r\n" + body,  # 200, its body ignored
    ]
    raw = b"".join(e + get_health for e in errors)
    raw += b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    responses = _exchange(_port(server), raw)
    statuses = [s for s, _ in responses]
    assert statuses == [404, 200, 405, 200, 401, 200, 403, 200, 415, 200, 405, 200, 200, 200, 200]
    assert all(b["status"] == "ok" for s, b in responses if s == 200)


def test_a_burst_of_200_connections_is_answered(server):
    """200 clients connecting at once: none is reset (the listen backlog holds them)."""
    port, results, errors = _port(server), [], []
    start = threading.Barrier(200)

    def client() -> None:
        try:
            start.wait(timeout=30)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
                results.append(r.status)
        except Exception as e:  # noqa: BLE001 - counted and shown below
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert errors == [] and results == [200] * 200


def test_a_short_body_times_out_and_frees_its_thread(tiny_model):
    """A body shorter than its Content-Length is answered 408 once the body deadline
    passes (here 1 s), the connection closed; the server goes on answering meanwhile.
    No model is needed: the body is read before any route runs."""
    srv = make_server(Backend(), "127.0.0.1", 0, body_timeout=1.0, on_request=lambda entry: None)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        port = srv.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"model"'
            )
            started = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=10) as r:
                assert r.status == 200  # answered while the short body waits
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            waited = time.monotonic() - started
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"8 of the 100 bytes" in data
        assert 0.5 < waited < 10
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_30_mb_message_is_refused_at_once_and_blocks_no_one(tiny_model, tmp_path):
    """At the default body limit (32 MB), a 30 MB message is refused before it reaches the
    engine (it could not fit the context), in well under the seconds tokenizing it would
    take, and a small request sent meanwhile is answered at once."""
    srv = start_server(tiny_model, tmp_path / "server.log")
    try:
        port = _port(srv)
        huge = json.dumps(_chat("hello there " * 2_500_000)).encode()
        assert len(huge) > 30_000_000
        answers: dict = {}

        def send_huge() -> None:
            started = time.monotonic()
            answers["huge"] = _exchange(port, _post("/v1/chat/completions", huge)), time.monotonic() - started

        thread = threading.Thread(target=send_huge)
        thread.start()
        time.sleep(0.05)
        started = time.monotonic()
        [(status, _)] = _exchange(port, _post("/v1/completions", GREEDY))
        small_took = time.monotonic() - started
        thread.join(timeout=60)
        [(huge_status, body)], huge_took = answers["huge"]
        assert huge_status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert status == 200 and small_took < 5 and huge_took < 10
    finally:
        srv.stop()
