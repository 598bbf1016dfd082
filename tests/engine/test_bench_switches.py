"""The switches' A/B in interleaved rounds: each variant its own bench process, paired with the
default run of the same round."""

from __future__ import annotations

import json

import pytest

from engine.cli import bench_switches as ab


def test_a_variant_is_name_value_settings():
    assert ab.parse_variant("A=1  B_2=x=y") == {"A": "1", "B_2": "x=y"}
    for bad in ("A", "1A=2", "=3", "", "   "):
        with pytest.raises(ab.SpecError):
            ab.parse_variant(bad)


def test_the_default_is_the_environment_less_what_any_variant_sets():
    base = {"PATH": "/bin", "MLX_DESK_QMV_COLUMNS": "4", "KEEP": "1"}
    default, first, second = ab.environments([{"MLX_DESK_QMV_COLUMNS": "8"}, {"OTHER": "1"}], base)
    assert default == {"PATH": "/bin", "KEEP": "1"}
    assert first == {**default, "MLX_DESK_QMV_COLUMNS": "8"}
    assert second == {**default, "OTHER": "1"}


def test_the_order_turns_each_round_so_no_variant_always_runs_first():
    orders = [ab.order(3, r) for r in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert {o[0] for o in orders} == {0, 1, 2}


def test_a_variant_is_judged_against_the_default_of_its_own_round():
    default = [100.0, 300.0, None, 200.0]
    variant = [110.0, 290.0, 400.0, None]
    rows = ab.summary([default, variant])
    assert rows[0]["median"] == 200.0 and rows[0]["best"] == 300.0 and "rounds_faster" not in rows[0]
    # rounds 3 and 4 have no pair; round 1 won, round 2 lost
    assert rows[1]["rounds_compared"] == 2 and rows[1]["rounds_faster"] == 1
    assert rows[1]["median_ratio"] == pytest.approx((1.1 + 290 / 300) / 2)
    assert ab.summary([[None], [None]])[1]["median_ratio"] is None


def test_a_failed_process_says_why_in_one_line():
    assert ab.why_failed("Traceback\n  File x\nModuleNotFoundError: No module named 'encodings'\n  tail") == (
        "ModuleNotFoundError: No module named 'encodings'"
    )
    assert ab.why_failed("") == "no output"
    assert ab.why_failed("just this\n") == "just this"


def test_rounds_of_real_bench_processes_with_a_failing_variant(capsys):
    """Two rounds on the tiny shape: the default and a switch each decode in both, a variant
    whose process cannot start is reported in each round and the others go on."""
    rc = ab.main(
        ["--shape", "tiny", "-p", "16", "-g", "4", "--repeat", "1", "--rounds", "2", "--json"]
        + ["--variant", "MLX_DESK_QMV_COLUMNS=4", "--variant", "PYTHONHOME=/no-python-home-here"]
    )
    out = capsys.readouterr().out
    assert rc == 1  # a variant failed
    data = json.loads(out.strip().splitlines()[-1])
    default, switched, broken = (
        data["variants"][k] for k in ("default", "MLX_DESK_QMV_COLUMNS=4", "PYTHONHOME=/no-python-home-here")
    )
    assert all(t > 0 for t in default["runs"] + switched["runs"]) and len(default["runs"]) == 2
    assert switched["rounds_compared"] == 2 and switched["median_ratio"] > 0
    assert broken["runs"] == [None, None] and broken["median"] is None
    assert out.count("failed: ModuleNotFoundError") == 2


def test_a_bad_variant_is_refused_before_any_run(capsys):
    assert ab.main(["--variant", "NOT A SETTING"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --variant takes NAME=VALUE") and err.count("\n") == 1
