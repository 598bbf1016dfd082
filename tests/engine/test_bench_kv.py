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
    out = _bench("--reopen", "--kv-bits", "4", "-p", "300")
    reopen = out["reopen"]
    assert reopen["cache_file_bytes"] > 0 and reopen["prefill_ttft_s"] > 0 and reopen["reopen_ttft_s"] > 0
    # The same cache saved by block (one block of 256 tokens and the rest): the same bytes and
    # a header per file (about a tenth more on this tiny model, nothing on a real one).
    assert reopen["by_block_ttft_s"] > 0
    assert 1 < reopen["by_block_bytes"] / reopen["cache_file_bytes"] < 1.25
    # The engine's own choice, and what it gave (the lesser path's time to first token).
    assert reopen["path"] in ("read", "recompute") and reopen["raw_read_s"] > 0
    chosen = reopen["reopen_ttft_s"] if reopen["path"] == "read" else reopen["prefill_ttft_s"]
    assert reopen["chosen_ttft_s"] == chosen


def test_bench_keeps_the_engines_figures_when_mlx_lm_cannot_run(monkeypatch, capsys):
    """On MLX's CUDA build mlx-lm's quantized KV cache has no quantized_matmul kernel for
    some shapes: its failure is reported in one line and the engine's rows and a valid
    --json object survive (mlx_lm null, the reason beside it)."""
    import pytest

    generate = pytest.importorskip("mlx_lm.generate")
    from engine.cli.main import main

    why = "[quantized_matmul] No implementation for problem shape: 2047x32767x128x32"

    def no_kernel(*_args, **_kwargs):
        raise ValueError(why)
        yield  # a generator, as mlx-lm's is

    monkeypatch.setattr(generate, "generate_step", no_kernel)
    argv = ["bench", "--shape", "tiny-qwen3.5", "-p", "64", "-g", "4", "--kv-bits", "8", "--kv-group-size", "32"]
    assert main([*argv, "--vs", "mlx-lm", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["engine"]["generated_tokens"] == 4 and out["engine"]["generation_tps"] > 0
    assert out["mlx_lm"] is None and out["mlx_lm_error"] == f"ValueError: {why}" and out["ratio"] is None
    assert any(line.startswith("engine ") for line in lines)
    assert f"mlx-lm   could not run this shape: ValueError: {why}" in lines
