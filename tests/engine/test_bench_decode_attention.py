"""``bench_decode_attention``: both buffer layouts timed for every keys x rows, and the
engine's pick beside them."""

from __future__ import annotations

import json

from engine.cli import bench_decode_attention
from engine.models.cache_buffers import buffer_tokens


def test_times_both_layouts_and_says_which_the_engine_picks(capsys):
    argv = ["--shape", "tiny", "--keys", "100,3000", "--rows", "1,4", "--calls", "2", "--repeat", "1", "--json"]
    assert bench_decode_attention.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = json.loads(lines[-1])
    assert [(r["keys"], r["rows"]) for r in rows] == [(100, 1), (100, 4), (3000, 1), (3000, 4)]
    for r in rows:
        assert r["whole_steps_us"] > 0 and r["padded_us"] > 0
        assert r["engine_buffer"] == buffer_tokens(r["keys"], rows=r["rows"])
    # 3,000 keys over 4 rows are past the vector kernel's share: whole steps.
    assert "engine: whole steps" in lines[-2]
    assert bench_decode_attention.main(["--keys", "0"]) == 2
    assert bench_decode_attention.main(["--rows", "x"]) == 2
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.strip().splitlines())


def test_chained_passes_each_take_the_previous_output(capsys, monkeypatch):
    import mlx.core as mx

    seen = []
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q)
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    argv = ["--shape", "tiny", "--keys", "50", "--rows", "1", "--calls", "3", "--repeat", "1", "--chain", "--ours"]
    assert bench_decode_attention.main(argv) == 0
    out = capsys.readouterr()
    assert "passes chained" in out.out
    # the last evaluation's three passes: each after the first takes the output before it
    first, second, third = seen[-3:]
    assert second is not first and third is not second and second.shape == first.shape
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        assert "CUDA backend only" in out.err
