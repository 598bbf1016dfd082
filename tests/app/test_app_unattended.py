"""The app's unattended modes, run as a user's shell would: ``--smoke-test`` and ``--quit-after-show``."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_smoke_test_replies_through_the_window(tiny_model, tmp_path):
    data = tmp_path / "data"
    proc = _run("--model", str(tiny_model), "--data-dir", str(data), "--smoke-test", "hello there")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    match = re.fullmatch(r"smoke-test: ok (\d+) tokens", lines[-2])
    assert match, proc.stdout
    reply = "\n".join(lines[:-2])
    report = json.loads(lines[-1])
    assert report["reply"] == reply and report["generated_tokens"] == int(match.group(1))
    assert report["window_shown_s"] <= report["model_loaded_s"], "the model loads after the window is up"
    assert report["streamed_chunks"] >= 2, "the reply reached the window in one piece, not streamed"
    assert proc.stderr == ""

    # Outside referee: the engine's own CLI, greedy, on the same chat prompt and length.
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(tiny_model),
            "--prompt",
            "hello there",
            "--chat",
            "--temp",
            "0",
            "--max-tokens",
            match.group(1),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout.strip().splitlines()[-1])
    assert reply == expected["text"]
    assert int(match.group(1)) == expected["generated_tokens"]

    # It went through the real window: the conversation is in the history.
    db = sqlite3.connect(data / "history.sqlite3")
    rows = db.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()
    db.close()
    assert rows == [("user", "hello there", "complete"), ("assistant", reply, "complete")]


def test_smoke_test_failure_is_one_line(tmp_path):
    proc = _run("--model", str(tmp_path / "missing"), "--data-dir", str(tmp_path / "d"), "--smoke-test", "hi")
    assert proc.returncode == 1
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("smoke-test: failed: ") and "missing" in line


def test_smoke_test_needs_a_model(tmp_path):
    proc = _run("--data-dir", str(tmp_path / "d"), "--smoke-test", "hi")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "smoke-test: failed: --smoke-test needs --model"


def test_quit_after_show_reports_the_cold_start(tmp_path):
    proc = _run("--data-dir", str(tmp_path / "d"), "--quit-after-show")
    assert proc.returncode == 0, proc.stderr
    match = re.fullmatch(r"window shown after (\d+\.\d{3}) s\n", proc.stdout)
    assert match, proc.stdout
    assert 0 < float(match.group(1)) < 120  # a sanity bound, not a target
    assert proc.stderr == ""


def test_heavy_imports_wait_until_after_the_window(tmp_path):
    """mlx, the worker, the hub client and the highlighter stay out of the first window."""
    script = f"""
import sys
from app.main import parse_args
from app.qt import QApplication
from app.store import HistoryStore
from app.bridge import EngineBridge
from app.ui.main_window import MainWindow
app = QApplication([])
window = MainWindow(HistoryStore({str(tmp_path / "d")!r}), EngineBridge())
window.show()
app.processEvents()
heavy = ["mlx", "engine.runtime.worker", "huggingface_hub", "pygments", "numpy"]
print(",".join(m for m in heavy if m in sys.modules))
"""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
