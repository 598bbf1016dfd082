"""End to end: the real app under Xvfb, typed into with xdotool, checked in SQLite.

Skips cleanly when Xvfb or xdotool is missing (CI installs both).
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (CI installs it)")
    return path


@pytest.fixture
def xdisplay():
    xvfb = _need("Xvfb")
    _need("xdotool")
    for n in range(90, 130):
        if not Path(f"/tmp/.X11-unix/X{n}").exists() and not Path(f"/tmp/.X{n}-lock").exists():
            break
    display = f":{n}"
    proc = subprocess.Popen(
        [xvfb, display, "-screen", "0", "1280x860x24", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    # Ready when a client gets an answer, not when the socket file appears: a CI run once had
    # the app fail to connect to a display whose socket was already there.
    while not (Path(f"/tmp/.X11-unix/X{n}").exists() and _xdotool(display, "getdisplaygeometry", timeout=5)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.skip("Xvfb did not start")
        time.sleep(0.05)  # waiting for another process's socket
    yield display
    proc.terminate()
    proc.wait(10)


def _xdotool(display: str, *args: str, timeout: float = 30) -> str:
    out = subprocess.run(
        ["xdotool", *args], env={**os.environ, "DISPLAY": display}, capture_output=True, text=True, timeout=timeout
    )
    return out.stdout.strip() if out.returncode == 0 else ""


def _wait(predicate, timeout: float, what: str, app: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if app.poll() is not None:
            pytest.fail(
                f"the app exited ({app.returncode}) while waiting for {what}: "
                f"{app.stdout.read().decode(errors='replace')[-2000:]}"
            )
        time.sleep(0.2)  # polling another process (window list, SQLite file)
    pytest.fail(f"timed out waiting for {what}")


def test_type_a_message_and_find_the_reply_in_history(xdisplay, tmp_path):
    model = make_tiny_llama(tmp_path / "tiny-llama")
    data = tmp_path / "data"
    shot = tmp_path / "window.png"
    env = {
        **os.environ,
        "DISPLAY": xdisplay,
        "QT_QPA_PLATFORM": "xcb",
        "MLX_DESK_SCREENSHOT": str(shot),
        "PYTHONPATH": str(ROOT),
    }
    app = subprocess.Popen(
        [sys.executable, "-m", "app.main", "--data-dir", str(data), "--model", str(model)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # The title names the model once it has loaded.
        wid = _wait(
            lambda: _xdotool(xdisplay, "search", "--name", "MLX Desk — tiny-llama"), 90, "the model to load", app
        ).split()[0]
        _xdotool(xdisplay, "windowfocus", "--sync", wid)
        _xdotool(xdisplay, "type", "--delay", "30", "hello there")
        _xdotool(xdisplay, "key", "Return")

        def reply():
            db_path = data / "history.sqlite3"
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
            try:
                return db.execute(
                    "SELECT u.content, a.content FROM messages a JOIN messages u"
                    " ON a.parent_id = u.id WHERE a.role='assistant' AND a.status='complete'"
                ).fetchone()
            finally:
                db.close()

        user_text, answer = _wait(reply, 120, "the reply in history.sqlite3", app)
        assert user_text == "hello there"
        assert answer.strip()
        _wait(shot.exists, 30, "the screenshot", app)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        if app.poll() is None:
            app.send_signal(signal.SIGTERM)
            try:
                app.wait(15)
            except subprocess.TimeoutExpired:
                app.kill()
                app.wait(10)
        app.stdout.close()
