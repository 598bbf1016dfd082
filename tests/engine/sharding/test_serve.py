"""``serve --hosts``: the HTTP API over a model split across local ranks answers as the
single process does, keeps its prefix cache in step across turns, and leaves no rank
running once the server is stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def chat(base: str, messages: list[dict], max_tokens: int = 8) -> dict:
    body = {"model": "llama", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        base + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sharded_server_answers_as_one_process(tmp_path):
    from engine.api import GenerationParams
    from engine.runtime.host import ModelHost

    model = make_tiny_llama(tmp_path / "llama", layers=4)
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0"]
    cmd += ["--hosts", "127.0.0.1,127.0.0.1", "--shard", "tensor"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT
    )
    try:
        base, deadline = None, time.monotonic() + 60
        while base is None or time.monotonic() < deadline:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            base = base or (m.group(1) if m else None)
            if line.startswith("rank 1 on 127.0.0.1"):  # the last rank's ready line: all loaded
                break
            assert line, "the server ended before serving"
        assert base is not None
        ranks = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        first = [{"role": "user", "content": "hello"}]
        one = chat(base, first)
        reply = one["choices"][0]["message"]["content"]
        two = chat(base, [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and you"}])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks)

    host = ModelHost()
    host.load(str(model))
    params = GenerationParams(max_tokens=8)
    expected_one = host.generate("s", first, params)
    assert reply == expected_one.text
    follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and you"}]
    assert two["choices"][0]["message"]["content"] == host.generate("s", follow, params).text
