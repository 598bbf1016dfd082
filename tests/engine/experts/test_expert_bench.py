"""``bench --resident-experts``: each residency's speed, hit rate and bytes read per token,
beside the disk's own read rates measured in the same run; ``serve`` takes the flag too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_bench_reports_each_residency_and_the_disk(tmp_path):
    out = run("bench", "--shape", "tiny-gpt-oss", "-p", "16", "-g", "6", "--resident-experts", "1,0.5,0.25", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("disk     sequential") for line in lines)
    result = json.loads(lines[-1])
    assert result["disk"]["sequential_bps"] > 0 and result["disk"]["random_bps"] > 0
    rows = {row["resident_experts"]: row for row in result["experts"]}
    assert set(rows) == {1.0, 0.5, 0.25}
    assert rows[1.0]["hit_rate"] == 1.0 and rows[1.0]["read_bytes_per_token"] == 0 and rows[1.0]["share_of_full"] == 1
    assert rows[0.25]["slots"] == 1 and rows[0.25]["experts"] == 4
    assert rows[0.25]["read_bytes_per_token"] > 0 and rows[0.25]["hit_rate"] < 1
    assert all(row["generation_tps"] > 0 for row in rows.values())
    # What the readers fetched ahead and the pass did not route is reported apart from what it read.
    assert all(row["wasted_bytes_per_token"] >= 0 for row in rows.values())
    assert rows[1.0]["misses_read_ahead"] is None and 0 <= rows[0.25]["misses_read_ahead"] <= 1


def test_a_kept_checkpoint_is_reused_by_the_next_run_of_the_same_shape(tmp_path):
    """--checkpoint-dir keeps the random checkpoint, and a run with the same shape, bits and
    seed reuses it (a large shape takes minutes to write); another seed writes a new one."""
    args = ("bench", "--shape", "tiny-gpt-oss", "-p", "8", "-g", "3", "--resident-experts", "0.5", "--json")
    first = run(*args, "--checkpoint-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    written = (tmp_path / "model.safetensors").stat().st_mtime_ns
    again = run(*args, "--checkpoint-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert "reusing the checkpoint" in again.stdout and "reusing" not in first.stdout
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == written
    rows = [json.loads(out.stdout.strip().splitlines()[-1])["experts"][0] for out in (first, again)]
    assert rows[0]["slots"] == rows[1]["slots"] and rows[0]["experts"] == rows[1]["experts"]
    other = run(*args, "--checkpoint-dir", str(tmp_path), "--seed", "7")
    assert other.returncode == 0, other.stderr
    assert "reusing" not in other.stdout and (tmp_path / "model.safetensors").stat().st_mtime_ns != written


def test_bench_refuses_a_dense_shape():
    out = run("bench", "--shape", "tiny", "-p", "4", "-g", "2", "--resident-experts", "0.5")
    assert out.returncode != 0 and "mixture-of-experts" in out.stderr


def test_serve_and_generate_take_the_flag():
    for command in ("serve", "generate", "inspect"):
        assert "--resident-experts" in run(command, "--help").stdout
    out = run("generate", "--model", "x", "--prompt", "hi", "--resident-experts", "1.5")
    assert out.returncode != 0 and "at most 1" in out.stderr
