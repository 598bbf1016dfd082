"""``python -m engine train``'s refusals: each ends with one line on stderr (bad rows are
listed before it, one line each with their line numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden" / "training"


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", "--model", str(GOLDEN / "model"), "--iters", "1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--memory-budget", "600KB"], "Training needs about"),
        (["--keys", "foo"], "No linear layer matches --keys foo"),
        (["--adapter-init", str(GOLDEN / "model")], "has no adapter_config.json"),
        (["--rank", "8", "--adapter-init", str(GOLDEN / "init_adapter"), "--layers", "2"], "match --rank"),
    ],
)
def test_refusals_are_one_line(tmp_path, extra, words):
    proc = train("--data", str(GOLDEN / "train.jsonl"), "--adapter-out", str(tmp_path / "a"), *extra)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "a" / "adapters.safetensors").exists()


def test_bad_rows_are_listed_then_refused_when_none_is_left(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"foo": 1}\nnot json\n')
    proc = train("--data", str(data), "--adapter-out", str(tmp_path / "a"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 3
    assert lines[0].startswith("skipped bad.jsonl line 1:") and lines[1].startswith("skipped bad.jsonl line 2:")
    assert "has no row to train on" in lines[2]
