"""Expert streaming as users meet it: ``generate``/``inspect`` with ``--resident-experts``,
the plan choosing to stream when the budget is short, a refusal in one line, and a
checkpoint that vanishes mid-reply (the reply ends with one line, keeps its text, and the
model unloads)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.api import ErrorEvent, Generate, GenerationParams, LoadModel, TokenEvent
from engine.runtime.worker import EngineWorker
from tests.engine.experts.moe_folders import model_folder
from tests.engine.runtime.test_worker import Events

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )


def generate_json(folder, *extra: str) -> dict:
    out = cli(
        "generate", "--model", str(folder), "--prompt-ids", "1,5,9,23,7", "--max-tokens", "8",
        "--ignore-eos", "--logprobs", "--json", *extra,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("cli"), "qwen3_moe")


def test_generate_reports_experts_and_matches_resident(folder):
    full = generate_json(folder)
    quarter = generate_json(folder, "--resident-experts", "0.25")
    assert quarter["token_ids"] == full["token_ids"]
    assert max(abs(a - b) for a, b in zip(quarter["token_logprobs"], full["token_logprobs"], strict=True)) <= 1e-5
    assert full["experts"]["resident_bytes"] == full["experts"]["total_bytes"] and full["experts"]["hit_rate"] == 1
    e = quarter["experts"]
    assert set(e) == {"total_bytes", "resident_bytes", "read_bytes", "hit_rate"}
    assert e["resident_bytes"] == e["total_bytes"] // 4 and e["read_bytes"] > 0 and 0 <= e["hit_rate"] < 1


def test_inspect_shows_the_slab_and_speed(folder):
    out = cli("inspect", str(folder), "--resident-experts", "0.5")
    assert out.returncode == 0, out.stderr
    assert "expert slab" in out.stdout and "2 of 4 experts" in out.stdout
    assert "streamed" in out.stdout and "of fully resident decoding" in out.stdout


def test_short_budget_streams_and_too_short_refuses(folder):
    # The golden qwen3_moe (bf16): 165 KB of non-expert weights, 49 KB of experts (12 KB a
    # slot across its MoE layer), 66 KB of KV for its 256-token context: 280 KB in all.
    streamed = generate_json(folder, "--memory-budget", "262000")  # 2 slots of 4
    e = streamed["experts"]
    assert e["resident_bytes"] == e["total_bytes"] // 2 and e["read_bytes"] > 0
    # A shorter context leaves the slab more: 16 KB of KV for 64 tokens, 3 slots in 220 KB.
    capped = generate_json(folder, "--memory-budget", "220000", "--context-length", "64")
    assert capped["experts"]["resident_bytes"] == capped["experts"]["total_bytes"] * 3 // 4
    out = cli("generate", "--model", str(folder), "--prompt-ids", "1,2", "--memory-budget", "240000")
    assert out.returncode != 0
    line = out.stderr.strip()
    assert "\n" not in line and "non-expert weights" in line and "minimal slab" in line and "KB" in line


def test_a_vanished_checkpoint_ends_the_reply_and_unloads(tmp_path):
    folder = model_folder(tmp_path, "qwen3_moe")
    moved = []

    class Vanishing(Events):
        def __call__(self, event) -> None:
            if isinstance(event, TokenEvent) and not moved:
                (folder / "model.safetensors").rename(tmp_path / "gone.safetensors")
                moved.append(True)
            super().__call__(event)

    events = Vanishing()
    worker = EngineWorker(events)
    worker.start()
    try:
        loaded = events.end_of(worker.submit(LoadModel(str(folder), resident_experts=0.01)))
        assert not isinstance(loaded, ErrorEvent), loaded
        params = GenerationParams(max_tokens=30, ignore_eos=True)
        rid = worker.submit(Generate("s", [{"role": "user", "content": "hi"}], params))
        end = events.end_of(rid)
        assert isinstance(end, ErrorEvent) and end.kind == "ExpertFileChanged"
        assert "model.safetensors" in end.message and "vanished" in end.message and "\n" not in end.message
        assert events.of(rid, TokenEvent)  # the text so far was sent and stays
        again = events.end_of(worker.submit(Generate("s", [{"role": "user", "content": "hi"}], params)))
        assert isinstance(again, ErrorEvent) and again.kind == "NoModelLoaded"
    finally:
        worker.shutdown()
