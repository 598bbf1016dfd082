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
