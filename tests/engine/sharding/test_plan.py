"""The per-rank plan (sized by each rank's room, refused naming rank, need and room), the
version check at connect, which files a rank opens, and refusals before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import OutOfMemoryBudget, UnsupportedModelError
from engine.models.sharding import ShardSpec, check_family
from engine.runtime.shard_load import share_files
from engine.runtime.shard_plan import WORKSPACE_BYTES, Sizes, plan_pipeline, plan_tensor
from engine.runtime.shard_rank import check_versions
from tests.engine.sharding.shard_folders import family_folder
from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
MB = 1 << 20
HOSTS = ["studio-1.local", "studio-2.local", "studio-3.local"]


def sizes(n_layers: int = 12, layer: int = 100 * MB) -> Sizes:
    return Sizes([layer] * n_layers, embed=50 * MB, head=50 * MB, tied=False)


def test_pipeline_layers_follow_each_ranks_room():
    room = 2000 * MB
    shares = plan_pipeline(sizes(), [room, 2 * room], HOSTS[:2])
    counts = [s.end - s.start for s in shares]
    assert sum(counts) == 12 and counts[1] > counts[0]  # twice the room, about twice the layers
    assert counts == [4, 8]
    assert shares[0].start == 0 and shares[0].end == shares[1].start and shares[1].end == 12
    even = plan_pipeline(sizes(), [room, room, room], HOSTS)
    assert [s.end - s.start for s in even] == [4, 4, 4]


def test_every_rank_gets_a_layer_and_needs_what_it_holds():
    shares = plan_pipeline(sizes(3), [10_000 * MB, 10 * 10_000 * MB, 10_000 * MB], HOSTS)
    assert [s.end - s.start for s in shares] == [1, 1, 1]
    assert shares[0].need == 100 * MB + 50 * MB + WORKSPACE_BYTES  # its layer and the embedding
    assert shares[2].need == 100 * MB + 50 * MB + WORKSPACE_BYTES  # its layer and the head


def test_a_split_that_cannot_fit_names_rank_host_need_and_room():
    with pytest.raises(OutOfMemoryBudget) as e:
        plan_pipeline(sizes(), [5000 * MB, 150 * MB], HOSTS[:2])  # even its one layer is too much
    text = str(e.value)
    assert text.startswith("rank 1 on studio-2.local needs 0.22 GB") and "room for 0.16 GB" in text
    with pytest.raises(OutOfMemoryBudget, match="rank 0 on studio-1.local needs .* for its 1/2 of every layer"):
        plan_tensor(sizes(), [100 * MB, 5000 * MB], HOSTS[:2])


def test_version_skew_is_refused_naming_the_rank():
    ours = {"engine": "0.1.0", "mlx": "0.32.4", "protocol": "1"}
    assert check_versions([ours, dict(ours)], HOSTS[:2]) is None
    problem = check_versions([ours, dict(ours), dict(ours, mlx="0.31.0")], HOSTS)
    assert problem is not None and problem.startswith("rank 2 on studio-3.local runs engine 0.1.0, mlx 0.31.0")


class Place:
    """Where a rank sits (what ShardSpec reads of an mx.distributed group)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_a_pipeline_rank_opens_only_the_files_of_its_share(tmp_path):
    folder = family_folder(tmp_path, "llama", make_tiny_llama(tmp_path / "tok"))
    first = share_files(folder, ShardSpec(Place(0, 2), "pipeline", 0, 1), tied=False)
    last = share_files(folder, ShardSpec(Place(1, 2), "pipeline", 1, 2), tied=False)
    assert [p.name for p in first] == ["model-layer000.safetensors", "model-rest.safetensors"]
    assert [p.name for p in last] == ["model-layer001.safetensors", "model-rest.safetensors"]
    middle = share_files(folder, ShardSpec(Place(1, 3), "pipeline", 1, 2), tied=False)
    assert [p.name for p in middle] == ["model-layer001.safetensors"]  # no embedding, no head


def test_families_that_do_not_shard_are_refused_naming_those_that_do():
    with pytest.raises(UnsupportedModelError) as e:
        check_family("gemma3", "pipeline")
    assert "llama" in str(e.value) and "deepseek_v3" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnsupportedModelError, match="tensor"):
        check_family("gpt_oss", "tensor")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--prompt-ids", "5,6", "--max-tokens", "2", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_cli_refuses_a_split_that_does_not_fit_before_loading(tmp_path):
    model = make_tiny_llama(tmp_path / "llama", layers=2)
    proc = run_cli("--model", str(model), "--hosts", "127.0.0.1,127.0.0.1", "--memory-budget", "1000000")
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("error: rank 0 on 127.0.0.1 needs"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
