"""bench --kv-bits and --reopen run at a tiny scale (the real shapes are for a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "bench", "--shape", "tiny", "-p", "64", "-g", "4", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_with_a_quantized_kv_cache():
    out = _bench("--kv-bits", "8", "--kv-group-size", "32")
    assert out["kv_cache"] == "8-bit g32" and out["engine"]["generated_tokens"] == 4


def test_bench_reopen_times_a_saved_cache_against_a_full_prefill():
    out = _bench("--reopen", "--kv-bits", "4")
    reopen = out["reopen"]
    assert reopen["cache_file_bytes"] > 0 and reopen["prefill_ttft_s"] > 0 and reopen["reopen_ttft_s"] > 0
