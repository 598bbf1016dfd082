"""A group of one rank: ``--hosts 127.0.0.1`` runs the model in one rank process and gives
the single process's reply (MLX's group of one for ring; NCCL forms its group of one,
the way a backend is checked on one GPU). A backend this MLX build lacks (NCCL on a CPU
build) is refused in one line naming what it has, and no rank is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("one_rank") / "llama", layers=3)


def generate(model: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt-ids", "5,6,7,8"]
    command += ["--max-tokens", "6", "--ignore-eos", "--temp", "0", "--json", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def ranks_of(model: Path) -> list[str]:
    """Any ``engine node`` process still running on ``model``: none once generate returns."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"node" in cmdline and str(model).encode() in cmdline:
            out.append(entry.name)
    return out


@pytest.mark.parametrize("shard", ["pipeline", "tensor"])
def test_one_rank_gives_the_single_process_reply(model, shard):
    single = generate(model)
    one = generate(model, "--hosts", "127.0.0.1", "--shard", shard)
    assert single.returncode == 0 and one.returncode == 0, one.stderr
    alone, ranked = json.loads(single.stdout), json.loads(one.stdout)
    assert ranked["token_ids"] == alone["token_ids"] and len(alone["token_ids"]) == 6
    assert [(r["rank"], r["layers"]) for r in ranked["ranks"]] == [(0, [0, 3])]


@pytest.mark.skipif(mx.distributed.is_available(backend="nccl"), reason="this MLX build has NCCL (a GPU build)")
def test_nccl_without_cuda_is_refused_in_one_line(model):
    run = generate(model, "--hosts", "127.0.0.1", "--backend", "nccl")
    assert run.returncode != 0 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "rank 0 on 127.0.0.1: this MLX build has no nccl backend (it has ring)" in lines[0]
    assert "Traceback" not in run.stderr
    assert ranks_of(model) == []
