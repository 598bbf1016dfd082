"""``python -m engine.cli.bench_qmm``: quantized products of a few rows against the floor."""

from __future__ import annotations

import json

from engine.cli import bench_qmm


def test_every_projection_and_row_count_is_timed_against_its_floor(capsys):
    assert (
        bench_qmm.main(
            ["--shape", "tiny", "--rows", "1,3", "--calls", "2", "--repeat", "1", "--copy-mb", "16", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(out["matrices"]) == set(bench_qmm.projections(bench_qmm.SHAPES["tiny"]))
    for t in out["matrices"].values():
        assert set(t["single_us"]) == set(t["batched_us"]) == {"1", "3"}
        assert all(v > 0 for v in [*t["single_us"].values(), *t["batched_us"].values()])
        assert abs(t["floor_us"] - t["bytes"] / out["bandwidth_bytes_per_s"] * 1e6) < 1e-6 * t["floor_us"]
    # 4-bit codes of a 64 -> 64 matrix, one bf16 scale and bias per 64 inputs.
    assert out["matrices"]["q 64->64"]["bytes"] == 64 * 64 // 2 + 2 * 64 * 2


def test_bad_row_counts_are_one_line(capsys):
    assert bench_qmm.main(["--shape", "tiny", "--rows", "1,x"]) == 2
    assert bench_qmm.main(["--shape", "tiny", "--rows", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
