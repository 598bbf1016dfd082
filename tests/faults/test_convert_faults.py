"""``convert`` into a disk that fills up: one line on stderr, a non-zero exit, and nothing
left behind (neither the output folder nor the hidden one it is written in first).

A full disk is stood in for by RLIMIT_FSIZE in the child: past the limit every write fails
with EFBIG (SIGXFSZ is ignored so the write returns the error instead of killing it), as
a write to a full volume fails with ENOSPC."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.main import main
from tests.tiny_models import make_tiny_llama

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("convert") / "model")


def _small_disk(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return apply


@pytest.mark.parametrize("extra", [[], ["-q"]], ids=["float", "quantized"])
def test_convert_into_a_full_disk_leaves_nothing(model, tmp_path, extra):
    out = tmp_path / "converted"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "engine", "convert", str(model), str(out), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=_small_disk(16 * 1024),
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write "), done.stderr
    assert "nothing was left behind" in lines[0]
    assert list(tmp_path.iterdir()) == [], f"left behind: {list(tmp_path.iterdir())}"


def test_a_convert_that_works_leaves_only_its_folder(model, tmp_path, capsys):
    out = tmp_path / "converted"
    out.mkdir()  # an empty folder made for the result is taken
    assert main(["convert", str(model), str(out), "-q"]) == 0, capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "2"]) == 0
