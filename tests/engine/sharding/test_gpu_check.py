"""The GPU check script, dry-run on this CPU build over ring: it writes a random-weight
checkpoint of a published shape, runs it as one process and as one rank (pipeline and
tensor) and passes only when the greedy ids agree; ids that part are reported where."""

from __future__ import annotations

from engine.cli.shard_gpu_check import main, parted


def test_one_rank_check_passes_on_the_same_ids(tmp_path, capsys):
    assert main(["check", "--backend", "ring", "--shapes", "tiny", "-p", "8", "-g", "6", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("ids equal") == 2 and out.strip().endswith("PASS")
    assert "one ring rank, tensor" in out and "decode" in out


def test_ids_that_part_say_where():
    assert parted([1, 2, 3], [1, 2, 3]) == "ids equal"
    assert parted([1, 2, 4], [1, 2, 3]) == "ids part at token 2"
    assert parted([1, 2], [1, 2, 3]) == "ids part at token 2"
