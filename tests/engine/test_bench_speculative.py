"""``python -m engine bench --speculative`` on the tiny shape, run as a subprocess."""

from __future__ import annotations

import pytest
from test_cli import last_json, run

BENCH = ["bench", "--shape", "tiny", "--bits", "4", "-p", "24", "-g", "12", "--num-draft", "3", "--json"]


@pytest.mark.parametrize("mode", ["ngram", "draft", "self"])
def test_plain_next_to_speculative(mode):
    proc = run(*BENCH, "--speculative", mode)
    assert proc.returncode == 0, proc.stderr
    spec = last_json(proc.stdout)["speculative"]
    assert spec["mode"] == mode and spec["num_draft"] == 3
    assert spec["plain"]["generated_tokens"] == spec["engine"]["generated_tokens"] == 12
    assert spec["engine"]["generation_tps"] > 0 and spec["speedup"] > 0
    assert 0 <= spec["accepted_draft_tokens"] <= spec["draft_tokens"] > 0
    assert isinstance(spec["identical_to_plain"], bool)
    # Where the runs part, for a bf16 check on a GPU (none here: the CPU build is exact).
    assert spec["identical_to_plain"] and spec["first_difference"] is None
    assert "tokens identical to plain greedy: yes" in proc.stdout
    assert spec["note"] in proc.stdout and "speed-up" in proc.stdout
    if mode == "ngram":
        assert "random passage repeated" in spec["note"]
    if mode == "self":
        assert spec["acceptance_rate"] > 0.5  # the model agrees with itself (up to bf16 near-ties)


def test_vs_mlx_lm_speculative_with_the_same_draft():
    pytest.importorskip("mlx_lm")
    proc = run(*BENCH, "--speculative", "draft", "--vs", "mlx-lm")
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert data["mlx_lm"]["generated_tokens"] == data["mlx_lm_speculative"]["generated_tokens"] == 12
    assert 0 <= data["mlx_lm_speculative"]["tokens_from_draft"] <= 12 and data["ratio_speculative"] > 0


def test_bad_draft_layers_is_one_line():
    proc = run("bench", "--shape", "tiny", "-p", "8", "-g", "4", "--speculative", "draft", "--draft-layers", "2")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "error: --draft-layers must be between 1 and 1 for this shape (got 2)"


def test_repeats_are_interleaved_and_each_run_is_reported():
    pytest.importorskip("mlx_lm")
    proc = run(*BENCH, "--speculative", "self", "--vs", "mlx-lm", "--repeat", "2")
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    spec = data["speculative"]
    for entry in (spec["plain"], spec["engine"], data["mlx_lm"], data["mlx_lm_speculative"]):
        assert len(entry["runs"]) == 2
        assert entry["generation_tps"] == max(r["generation_tps"] for r in entry["runs"])


@pytest.mark.parametrize("failing", ["speculative_generate_step", "generate_step"])
def test_the_engines_figures_stand_when_mlx_lm_cannot_run(monkeypatch, capsys, failing):
    """mlx-lm fails on some shapes on MLX's CUDA build: its failure (speculative loop, or its
    plain loop and so both) is one line, and the engine's rows and a valid --json object stay."""
    import json

    generate = pytest.importorskip("mlx_lm.generate")
    from engine.cli.main import main

    why = "[quantized_matmul] No implementation for problem shape: 5x2048x64x32"

    def no_kernel(*_args, **_kwargs):
        raise ValueError(why)
        yield  # a generator, as mlx-lm's are

    monkeypatch.setattr(generate, failing, no_kernel)
    assert main([*BENCH, "--speculative", "draft", "--vs", "mlx-lm"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    spec = out["speculative"]
    assert spec["plain"]["generated_tokens"] == spec["engine"]["generated_tokens"] == 12
    assert any(line.startswith("engine ") for line in lines) and any(line.startswith("engine+draft ") for line in lines)
    assert out["mlx_lm_error"] == f"ValueError: {why}"
    if failing == "generate_step":
        assert out["mlx_lm"] is None and "mlx_lm_speculative" not in out
        assert f"{'mlx-lm':<16} could not run this shape: ValueError: {why}" in lines
    else:
        assert out["mlx_lm"]["generated_tokens"] == 12 and any(line.startswith("mlx-lm ") for line in lines)
        assert out["mlx_lm_speculative"] is None and out["ratio_speculative"] is None
        assert f"{'mlx-lm+draft':<16} could not run this shape: ValueError: {why}" in lines


@pytest.mark.parametrize("mode, compiled", [("self", True), ("ngram", False)])
def test_auto_depth_says_where_the_time_went(mode, compiled):
    extra = ["--compiled"] if compiled else []
    proc = run(*BENCH[:-3], "--num-draft", "auto", "--json", "--speculative", mode, *extra)
    assert proc.returncode == 0, proc.stderr
    spec = last_json(proc.stdout)["speculative"]
    assert spec["num_draft"] == "auto" and spec["warm_up_ms"] > 0
    b = spec["breakdown"]
    # The last run's tokens after the first: plain ones and what rounds yielded (a round's
    # last tokens may lie past the end).
    assert b["plain_tokens"] + b["round_tokens"] >= spec["engine"]["generated_tokens"] - 1
    assert b["plain_tokens"] == 0 or b["plain_ms_per_token"] > 0
    assert b["plain_loop_ms_per_token"] > 0 and b["generation_ms"] > 0
    assert 0 <= b["first_use_rounds"] <= b["rounds"]
    for line in ("where the time went", "plain tokens", "rounds", "catching up", "unaccounted"):
        assert line in proc.stdout
    assert "warm-up: rounds of 1, 2, 4 drafts" in proc.stdout  # the depths auto may choose without Metal
    if compiled:  # every verify size was compiled in the warm-up, none in the timed runs
        assert b["rounds"] > 0 and b["first_use_rounds"] == 0


def test_first_difference_names_where_runs_part():
    from engine.cli.bench_speculative import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 4, 5], [1, 2, 3, 5]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one run stopped early
