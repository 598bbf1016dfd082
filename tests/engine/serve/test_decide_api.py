"""``POST /v1/decide`` on a running server: the same numbers as the engine's own scoring,
chat messages as prompts, and bad input answered 400 with one line."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from engine.api import Decide
from engine.runtime.decide import decide
from engine.runtime.host import ModelHost

from .conftest import start_server


def post(base: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        base + "/v1/decide", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_decide_over_http(tiny_model, tmp_path):
    host = ModelHost()
    host.load(str(tiny_model))
    local = decide(host, Decide(candidates=[" fox", " dog", " sun"], prompt="the quick brown"))
    srv = start_server(tiny_model, tmp_path / "server.log")
    try:
        status, out = post(srv.base, {"model": "tiny-chat", "prompt": "the quick brown", "candidates": [" fox", " dog", " sun"]})  # fmt: skip
        assert status == 200, out
        assert out["object"] == "decision" and out["candidates"] == [" fox", " dog", " sun"]
        assert out["logprobs"] == pytest.approx(local.logprobs, abs=1e-5)
        assert sum(out["probabilities"]) == pytest.approx(1.0)
        status, chat = post(srv.base, {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                       "candidates": ["hello", "bye"]})  # fmt: skip
        assert status == 200 and len(chat["logprobs"]) == 2, chat
        for body, words in [
            ({"prompt": "x", "candidates": []}, "non-empty list"),
            ({"prompt": "x", "candidates": ["a", ""]}, "Candidate 2 is empty"),
            ({"prompt": [1, 2], "candidates": [[4, 999]]}, "outside the model's vocabulary"),
            ({"prompt": [1, 2], "candidates": [[4] * 2100]}, "longer than the model's context"),
        ]:
            status, err = post(srv.base, {"model": "tiny-chat", **body})
            message = err["error"]["message"]
            assert status == 400 and words in message and "\n" not in message, err
    finally:
        srv.stop()


def test_decisions_have_their_own_admission_pool(tiny_model):
    import threading

    from engine.serve import decide_api
    from engine.serve.backend import Backend
    from engine.serve.server import make_server

    backend = Backend()
    backend.start(str(tiny_model))
    assert backend.loaded.wait(60) and backend.load_error is None
    server = make_server(backend, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    body = {"model": backend.info.name, "prompt": "the quick", "candidates": [" fox", " dog"]}
    pool = decide_api._pool(server)
    try:
        for _ in range(decide_api.MAX_DECISIONS):  # as many decisions as the pool holds, in flight
            assert pool.acquire(blocking=False)
        status, err = post(base, body)
        assert status == 429 and "decision requests are already waiting" in err["error"]["message"]
        # Generation is admitted apart: a completion still runs while decisions are full.
        request = urllib.request.Request(
            base + "/v1/completions",
            json.dumps({"model": backend.info.name, "prompt": "hi", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
        pool.release()
        status, out = post(base, body)
        assert status == 200 and len(out["probabilities"]) == 2
    finally:
        for _ in range(decide_api.MAX_DECISIONS - 1):
            pool.release()
        server.shutdown()
        server.server_close()
        backend.shutdown()
