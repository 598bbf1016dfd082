"""Every family that shards gives, split across local ranks (ring over loopback), the
single process's greedy ids and log-probs within 1e-4, with each rank's weights measured.

One group of ranks serves all families in turn (``RankGroup.load``): starting ranks is
the expensive part on a small machine.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.api import GenerationParams
from engine.cli.convert import convert
from engine.runtime.shard_group import RankGroup
from tests.engine.sharding.shard_folders import family_folder, prompt_ids, single_process
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

PIPELINE = ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss"]
PIPELINE += ["qwen3_5", "qwen3_5_moe"]
TENSOR = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2"]
QUANTIZED = ["llama", "qwen3_moe"]  # 4-bit, group 32: both splits
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard_families")
    tokenizer_dir = make_tiny_llama(root / "tokenizer")
    folders = {name: family_folder(root, name, tokenizer_dir) for name in sorted(set(PIPELINE + TENSOR))}
    for name in QUANTIZED:
        convert(folders[name], root / f"q4_{name}", quantize_bits=4, group_size=32, dtype="float32")
        folders[f"q4_{name}"] = root / f"q4_{name}"
    return folders


def request(ids: list[int]) -> dict:
    params = GenerationParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
    return {"op": "generate_ids", "ids": ids, "params": dataclasses.asdict(params)}


def sharded(group: RankGroup, ids: list[int]) -> dict:
    events = list(group.run(request(ids)))
    return events[-1]["result"]


def check_same(name: str, mode: str, result: dict, reference: tuple[list[int], list[float], int]) -> None:
    ids, logprobs, _ = reference
    assert result["token_ids"] == ids, (name, mode)
    assert max(abs(a - b) for a, b in zip(result["token_logprobs"], logprobs)) < 1e-4, (name, mode)


def check_ranks(ranks: list[dict], mode: str, n: int, whole: int) -> None:
    assert [r["rank"] for r in ranks] == list(range(n))
    assert all(0 < r["weight_bytes"] < whole for r in ranks)  # each holds a share, not the model
    if mode == "pipeline":  # contiguous ranges covering every layer once
        assert ranks[0]["layers"][0] == 0
        assert all(a["layers"][1] == b["layers"][0] for a, b in zip(ranks, ranks[1:]))


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
def test_every_family_matches_one_process(folders, n_ranks):
    runs = [(name, "pipeline") for name in PIPELINE]
    if n_ranks == 2:
        runs += [(name, "tensor") for name in TENSOR]
        runs += [(f"q4_{name}", mode) for name in QUANTIZED for mode in ("pipeline", "tensor")]
    elif n_ranks == 3:  # latent attention and a hybrid: a middle rank both receives and sends
        runs = [(n, m) for n, m in runs if n in ("deepseek_v3", "qwen3_5")]
    else:  # four ranks: one layer each of the four-layer hybrid (recurrent and attention layers)
        runs = [("qwen3_5_moe", "pipeline")]
    references = {name: single_process(folders[name], prompt_ids(name), MAX_TOKENS) for name, _ in runs}
    first, mode = runs[0]
    group = RankGroup(["127.0.0.1"] * n_ranks, ["--model", str(folders[first]), "--shard", mode])
    group.start()
    try:
        ranks = group.wait_ready()
        for i, (name, mode) in enumerate(runs):
            if i > 0:
                ranks = group.load(str(folders[name]), mode)
            check_ranks(ranks, mode, n_ranks, references[name][2])
            check_same(name, mode, sharded(group, prompt_ids(name)), references[name])
    finally:
        group.close()
    assert all(_gone(pid) for pid in group.pids)


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
