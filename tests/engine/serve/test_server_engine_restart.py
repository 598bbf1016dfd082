"""An engine whose loop stopped (a fault that escaped its per-request handling) makes
/health say so, the server starts a fresh engine with the same model, and then answers
as before; past its restarts it refuses clearly instead of answering "ok"."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine.serve import backend as backend_module
from engine.serve.backend import Backend
from engine.serve.server import address, make_server

GREEDY = {"model": "tiny-chat", "prompt": "the quick brown", "max_tokens": 6, "temperature": 0}


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def _wait_healthy(base: str) -> None:
    for _ in range(300):  # bounded: 60 s
        if _call(base + "/health")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the server never became healthy again")


def _stop_the_loop(backend: Backend) -> None:
    """Make the engine's next command end its loop, as an escaped fault would."""

    def crash(*args, **kwargs):
        raise SystemExit("simulated fault in the engine loop")

    backend.worker._handle = crash  # the worker object in use now; a restart makes a new one


@pytest.fixture
def served(tiny_model):
    backend = Backend()
    srv = make_server(backend, "127.0.0.1", 0, on_request=lambda entry: None)
    backend.start(str(tiny_model))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    base = address(srv)
    _wait_healthy(base)
    yield backend, base
    srv.shutdown()
    srv.server_close()
    backend.shutdown()


# The engine's thread ends with the fault (it re-raises it): that is the case under test.
dies = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@dies
def test_a_stopped_engine_is_reported_and_restarted(served):
    backend, base = served
    status, before = _call(base + "/v1/completions", GREEDY)
    assert status == 200
    _stop_the_loop(backend)
    # Scoring runs outside the batch, through the handler the fault is in.
    status, body = _call(base + "/v1/completions", {**GREEDY, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 500 and "engine stopped" in body["error"]["message"]
    status, body = _call(base + "/health")
    assert status == 503 and "restarting" in body["error"]["message"]
    _wait_healthy(base)
    assert backend.restarts == 1 and "simulated fault" in backend.last_stop
    assert _call(base + "/health")[1]["restarts"] == 1
    status, after = _call(base + "/v1/completions", GREEDY)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]


@dies
def test_past_its_restarts_the_engine_is_refused_clearly(served, monkeypatch):
    backend, base = served
    monkeypatch.setattr(backend_module, "MAX_RESTARTS", 0)
    _stop_the_loop(backend)
    _call(base + "/v1/completions", {**GREEDY, "max_tokens": 0, "echo": True, "logprobs": 1})
    for path, body in (("/health", None), ("/v1/completions", GREEDY), ("/v1/models", None)):
        status, answer = _call(base + path, body)
        assert status == 503, (path, answer)
        assert "was not restarted" in answer["error"]["message"]
