"""``python -m engine bench --concurrent`` on the tiny shape, run as a subprocess."""

from __future__ import annotations

import pytest
from test_cli import last_json, run

BENCH = ["bench", "--shape", "tiny", "--bits", "16", "-p", "16", "-g", "8", "--json"]


def test_streams_together_next_to_mlx_lm_batching():
    pytest.importorskip("mlx_lm")
    proc = run(*BENCH, "--concurrent", "1,3", "--vs", "mlx-lm")
    assert proc.returncode == 0, proc.stderr
    rows = last_json(proc.stdout)["concurrent"]
    assert [r["engine"]["streams"] for r in rows] == [1, 3]
    for r, n in zip(rows, (1, 3), strict=True):
        for side in ("engine", "mlx-lm"):
            assert r[side]["generated_tokens"] == 8 * n
            assert r[side]["total_tps"] > 0
            assert r[side]["per_stream_tps"] == pytest.approx(r[side]["total_tps"] / n)
        assert r["ratio"] > 0 and isinstance(r["same_tokens_as_mlx_lm"], bool)
    assert rows[0]["same_tokens_as_mlx_lm"]  # one stream, same weights, greedy
    assert "per stream" in proc.stdout


def test_a_family_that_cannot_batch_and_bad_counts_are_one_line():
    proc = run("bench", "--shape", "tiny-gpt-oss", "--bits", "16", "-p", "8", "-g", "4", "--concurrent", "2")
    assert proc.returncode != 0 and "do not batch" in proc.stderr and proc.stderr.count("\n") == 1
    proc = run(*BENCH, "--concurrent", "0,x")
    assert proc.returncode != 0 and "--concurrent" in proc.stderr and "Traceback" not in proc.stderr
