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


def test_each_warp_slice_length_is_timed_with_its_own_launches_then_put_back(monkeypatch):
    from engine.models import decode_attention_cuda as ours

    seen = []

    def fake_pass(*args, **kwargs):
        seen.append((ours.KEYS_PER_WARP, ours.plan(1, 32, 8, 1, 520, 128, ours.mx.bfloat16)[1]))
        return 1.0

    monkeypatch.setattr(bench_decode_attention, "time_pass", fake_pass)
    kept = ours.KEYS_PER_WARP
    for length in (16, None):
        assert bench_decode_attention._time_ours((32, 8, 128), 520, 1, 528, {}, length) == 1.0
    assert ours.KEYS_PER_WARP == kept
    # 520 keys over slices of 16: 33, rounded up to whole blocks of warps
    assert seen == [(16, 36), (kept, ours.plan(1, 32, 8, 1, 520, 128, ours.mx.bfloat16)[1])]
    assert bench_decode_attention.main(["--keys-per-warp", "16,x"]) == 2
