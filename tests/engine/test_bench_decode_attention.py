"""``bench_decode_attention``: both buffer layouts timed for every keys x rows, and the
engine's pick beside them."""

from __future__ import annotations

import json

from engine.cli import bench_decode_attention
from engine.models.kv_cache import buffer_tokens


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
