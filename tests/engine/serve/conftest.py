"""A server started the way a user starts it: ``python -m engine serve`` in a subprocess,
on 127.0.0.1 and a port the OS picks, over a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[3]

API_KEY = "test-key-123"


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path, err):
        self.proc, self.base, self.log, self._err = proc, base, log, err

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc.stdout.close()
        self._err.close()


def start_server(model: Path, log: Path, *extra: str, ready: bool = True) -> Server:
    """Start the CLI, read the address it prints, and (``ready``) wait for /health."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0", *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    server = Server(proc, line.split()[-1] if line else "", log, err)
    if not line.startswith("listening on http://127.0.0.1:"):
        server.stop()
        raise AssertionError(f"server did not start: {line!r} {log.read_text()}")
    if ready:
        for _ in range(300):  # bounded: 60 s
            try:
                with urllib.request.urlopen(server.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:
                with e:
                    assert e.code == 503, e.read()
            except OSError:
                pass
            time.sleep(0.2)
        else:
            server.stop()
            raise AssertionError(f"server never became ready: {log.read_text()}")
    return server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    srv = start_server(tiny_model, log, "--api-key", API_KEY, "--max-request-bytes", "65536")
    yield srv
    srv.stop()


def post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())
