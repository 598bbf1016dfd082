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
        assert set(t["single_us"]) == set(t["batched_us"]) == set(t["compiled_us"]) == {"1", "3"}
        assert all(v > 0 for k in ("single_us", "batched_us", "compiled_us") for v in t[k].values())
        assert abs(t["floor_us"] - t["bytes"] / out["bandwidth_bytes_per_s"] * 1e6) < 1e-6 * t["floor_us"]
    # 4-bit codes of a 64 -> 64 matrix, one bf16 scale and bias per 64 inputs.
    assert out["matrices"]["q 64->64"]["bytes"] == 64 * 64 // 2 + 2 * 64 * 2


def test_bad_row_counts_are_one_line(capsys):
    assert bench_qmm.main(["--shape", "tiny", "--rows", "1,x"]) == 2
    assert bench_qmm.main(["--shape", "tiny", "--rows", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_ours_is_refused_in_one_line_without_cuda_and_timed_beside_mlxs_with_it(capsys):
    from engine.models import quantized_matmul_cuda as qmv

    argv = ["--shape", "tiny", "--rows", "1,17", "--calls", "2", "--repeat", "1", "--copy-mb", "16", "--json", "--ours"]
    if not qmv.available():
        assert bench_qmm.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "CUDA" in err[0]
        return
    assert bench_qmm.main(argv) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    for t in out["matrices"].values():
        # 17 rows are past the kernel's reach: MLX's figures only.
        assert set(t["ours_single_us"]) == set(t["ours_batched_us"]) == set(t["ours_vs_mlx"]) == {"1"}
        assert set(t["ours_compiled_us"]) == {"1"}
        assert t["ours_vs_f32"]["1"] <= 0.05


def test_cold_products_take_turns_over_enough_distinct_weights(capsys):
    argv = ["--shape", "tiny", "--rows", "1", "--calls", "3", "--repeat", "1", "--copy-mb", "16", "--json"]
    assert bench_qmm.main([*argv, "--cold-mb", "1"]) == 0
    cold = json.loads(capsys.readouterr().out.splitlines()[-1])
    # q 64->64 is 4,608 bytes: 1 MB would take 228 weights, so every one of the 3 calls has its own.
    assert cold["matrices"]["q 64->64"]["weights"] == 3
    assert bench_qmm.main(argv) == 0
    warm = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert warm["matrices"]["q 64->64"]["weights"] == 1
    assert bench_qmm.main([*argv, "--cold-mb", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --cold-mb must be 0 or more"
