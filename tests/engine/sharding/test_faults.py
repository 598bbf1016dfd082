"""A sharded reply under faults and control: a rank killed or stopped mid-reply ends it
within 5 s with one line naming the rank and its host and leaves no rank running; Stop
reaches every rank at the same step (the group stays usable); a seeded sampled reply is
the one process's."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.runtime.shard_group import RankGroup, RankLost
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("shard_faults") / "llama", layers=4)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie not yet reaped by its parent is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def long_reply(**sampling) -> dict:
    params = GenerationParams(max_tokens=100_000, ignore_eos=True, sampling=SamplingParams(**sampling))
    return {"op": "generate_ids", "ids": [5, 6, 7, 8], "params": dataclasses.asdict(params)}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_lost_rank_ends_the_reply_within_5_s_naming_it(model, how):
    group = RankGroup(["127.0.0.1", "127.0.0.1"], ["--model", str(model), "--shard", "pipeline"])
    group.start()
    pids = group.pids
    try:
        group.wait_ready()
        events = group.run(long_reply())
        text = "".join(next(events).get("token", "") for _ in range(5))
        os.kill(pids[1], how)
        start = time.monotonic()
        with pytest.raises(RankLost) as lost:
            for _ in events:
                pass
        assert time.monotonic() - start < 5.0
    finally:
        group.close()
        if how == signal.SIGSTOP and not gone(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
    assert str(lost.value).startswith("rank 1 on 127.0.0.1 stopped answering")
    assert "\n" not in str(lost.value)
    assert text
    assert all(gone(pid) for pid in pids)


def test_cli_reply_keeps_its_text_and_leaves_no_rank(model):
    """The command line: tokens printed so far stay, one line on stderr, no rank left."""
    cmd = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt-ids", "5,6,7,8"]
    cmd += ["--max-tokens", "100000", "--ignore-eos", "--hosts", "127.0.0.1,127.0.0.1", "--shard", "pipeline"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = proc.stdout.read(8)  # type: ignore[union-attr]
    ranks = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ]
    assert len(ranks) == 2
    rank1 = max(ranks, key=lambda pid: Path(f"/proc/{pid}/environ").read_bytes().count(b"MLX_RANK=1"))
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - start < 5.0
    assert proc.returncode != 0
    assert len(first + out) > 8
    lines = err.decode().strip().splitlines()
    assert lines[-1].startswith("error: rank 1 on 127.0.0.1 stopped answering")
    assert all(gone(pid) for pid in ranks)


def test_stop_reaches_every_rank_and_seeded_sampling_is_one_process(model):
    from engine.runtime.host import ModelHost

    group = RankGroup(["127.0.0.1", "127.0.0.1"], ["--model", str(model), "--shard", "tensor"])
    group.start()
    try:
        group.wait_ready()
        events = group.run(long_reply())
        for _ in range(3):
            next(events)
        group.stop()
        result = [e for e in events if "result" in e][0]["result"]
        assert result["finish_reason"] == "cancelled"
        # Every rank left the reply at the same step: the next one runs (it would hang otherwise).
        params = GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=7))
        cmd = {"op": "generate_ids", "ids": [5, 6, 7, 8], "params": dataclasses.asdict(params)}
        sharded = [e for e in group.run(cmd) if "result" in e][0]["result"]
    finally:
        group.close()
    host = ModelHost()
    host.load(str(model))
    assert sharded["token_ids"] == host.generate_ids([5, 6, 7, 8], params).token_ids


def test_quantized_kv_cache_per_rank_matches_one_process(model):
    def generate(*extra: str) -> dict:
        cmd = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt-ids", "1,2,3,4,5,6,7,8"]
        cmd += ["--max-tokens", "6", "--ignore-eos", "--logprobs", "--json", "--kv-bits", "8", "--kv-group-size", "32"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    one = generate()
    split = generate("--hosts", "127.0.0.1,127.0.0.1", "--shard", "pipeline")
    assert split["token_ids"] == one["token_ids"]
    assert max(abs(a - b) for a, b in zip(split["token_logprobs"], one["token_logprobs"])) < 1e-4
    assert [r["layers"] for r in split["ranks"]] == [[0, 2], [2, 4]]


def test_each_rank_saves_its_part_and_another_split_is_refused(model, tmp_path):
    cache = tmp_path / "chat.safetensors"

    def generate(mode: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt-ids", "1,2,3,4,5,6,7,8"]
        cmd += ["--max-tokens", "4", "--ignore-eos", "--json", "--cache-file", str(cache)]
        cmd += ["--hosts", "127.0.0.1,127.0.0.1", "--shard", mode]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    first = json.loads(generate("pipeline").stdout.splitlines()[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.rank0-of-2.safetensors", "chat.rank1-of-2.safetensors"]
    again = json.loads(generate("pipeline").stdout.splitlines()[-1])
    assert again["cached_tokens"] == 7 and again["token_ids"] == first["token_ids"]
    other = generate("tensor")
    assert json.loads(other.stdout.splitlines()[-1])["cached_tokens"] == 0
    assert "another split" in other.stderr


def test_cli_chat_with_sampling_prints_what_one_process_prints(model):
    def generate(*extra: str) -> dict:
        cmd = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt", "hello there", "--chat"]
        cmd += ["--system", "be brief", "--max-tokens", "8", "--temp", "0.8", "--seed", "3", "--json"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    one = generate()
    split = generate("--hosts", "127.0.0.1,127.0.0.1,127.0.0.1", "--shard", "pipeline")
    assert (split["text"], split["token_ids"], split["prompt_tokens"]) == (
        one["text"],
        one["token_ids"],
        one["prompt_tokens"],
    )
