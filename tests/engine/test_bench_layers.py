"""``python -m engine.cli.bench_layers`` times each layer kind of a hybrid shape next to
mlx-lm's same layer on the same weights (and the engine's compiled recurrent layer)."""

from __future__ import annotations

import pytest

from engine.cli import bench_layers

pytest.importorskip("mlx_lm")


def test_every_layer_kind_is_timed_on_both_sides(capsys):
    assert bench_layers.main(["--shape", "tiny-qwen3.5-moe", "-p", "16", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:40].strip(): line[40:].split() for line in lines[2:]}
    for what in (
        "gated DeltaNet mixer, decode",
        "gated DeltaNet mixer, prompt",
        "attention mixer, prompt",
        "attention layer, decode",
        "feed-forward (experts), decode",
        "feed-forward (experts), prompt",
    ):
        engine, mlx_lm, ratio = rows[what]
        assert float(engine) > 0 and float(mlx_lm) > 0 and float(ratio) > 0
    assert float(rows["gated DeltaNet layer, compiled decode"][0]) > 0
