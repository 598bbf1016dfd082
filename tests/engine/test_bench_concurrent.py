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


def test_profile_reports_each_step_and_prefill_on_both_sides():
    pytest.importorskip("mlx_lm")
    proc = run(*BENCH, "--concurrent", "4", "--vs", "mlx-lm", "--profile")
    assert proc.returncode == 0, proc.stderr
    (row,) = last_json(proc.stdout)["concurrent"]
    ours, theirs = row["engine"]["profile"], row["mlx-lm"]["profile"]
    # Four 16-token prompts prefilled together in one pass, then 8 steps of 4 rows each.
    assert ours["prefill_passes"] == 1 and ours["prefill_tokens_per_pass"] == 4 * 15
    assert ours["decode_steps"] == 8 and ours["mean_rows"] == 4 and ours["masked_steps"] == 0
    assert ours["launch_ms"] > 0 and ours["settle_ms"] >= 0
    assert theirs["decode_steps"] == 8 and theirs["decode_ms"] > 0
    for side in ("engine", "mlx-lm"):
        assert row[side]["prefill_tps"] > 0
    assert "launch" in proc.stdout and "settle" in proc.stdout


def test_staggered_arrivals_decode_padded_rows_on_both_sides():
    pytest.importorskip("mlx_lm")
    proc = run(*BENCH, "--concurrent", "3", "--vs", "mlx-lm", "--profile", "--stagger", "2")
    assert proc.returncode == 0, proc.stderr
    (row,) = last_json(proc.stdout)["concurrent"]
    for side in ("engine", "mlx-lm"):
        assert row[side]["generated_tokens"] == 3 * 8
    # Each newcomer prefilled on its own, into a batch of rows of other lengths: masked steps.
    ours = row["engine"]["profile"]
    assert ours["prefill_passes"] == 3 and ours["masked_steps"] > 0
    assert ours["mean_rows"] < 3
