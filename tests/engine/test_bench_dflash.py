"""``python -m engine.cli.bench_dflash``: a DFlash round against a plain step, on the tiny shape."""

from __future__ import annotations

import json

import pytest

from engine.cli.bench_dflash import main, target_layer_ids
from engine.decode.draft_depth import expected_tokens


def test_target_layers_are_spaced_as_published():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16's config
    assert target_layer_ids(2, 2) == [1]


def test_the_bench_reports_a_round_against_a_step(capsys):
    assert (
        main(["--shape", "tiny", "--block", "6", "--draft-layers", "2", "--context", "32", "--steps", "2", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["plain_step_ms"] > 0 and out["dflash_round_ms"] > 0
    assert out["round_over_step"] == out["dflash_round_ms"] / out["plain_step_ms"]
    assert abs(out["upper_bound_tok_s"] - 6 / (out["dflash_round_ms"] / 1000)) < 1e-6
    if out["break_even_acceptance"] is not None:  # the acceptance that yields the tokens needed
        assert abs(expected_tokens(out["break_even_acceptance"], 5) - out["break_even_tokens_per_round"]) < 1e-6


def test_the_side_by_side_runs_mlx_vlms_dflash_on_our_weights(capsys):
    """mlx-vlm's DFlash generator on our random target and drafter: both sides decode the
    target's greedy continuation (our plain greedy run), so the tokens agree."""
    pytest.importorskip("mlx_vlm")
    argv = ["--shape", "tiny", "--block", "6", "--draft-layers", "2", "--context", "32"]
    assert main([*argv, "--vs", "mlx-vlm", "-g", "16", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    agree = out["greedy_agreement"]
    assert agree["of"] == 16
    assert agree["engine_dflash_vs_plain"] == 16 and agree["dflash"] == 16
    assert out["mlx_vlm_dflash"]["generated_tokens"] == 16
    assert out["dflash_ratio"] == out["engine_dflash"]["generation_tps"] / out["mlx_vlm_dflash"]["generation_tps"]
