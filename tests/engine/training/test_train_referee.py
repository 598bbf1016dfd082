"""Training against its referees (tests/golden/make_train_goldens.py): from the same PEFT
adapter and data with plain SGD, the engine's losses equal transformers + PEFT's, the
saved adapter gives PEFT's greedy ids through ``generate --adapter``, and mlx-lm loads
the adapter and generates the engine's greedy ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden" / "training"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


def engine(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", *args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("train") / "adapter"
    report = engine(
        "train", "--model", str(GOLDEN / "model"), "--data", str(GOLDEN / "train.jsonl"), "--adapter-out", str(out),
        "--adapter-init", str(GOLDEN / "init_adapter"), "--optimizer", "sgd", "--lr", str(EXPECTED["lr"]),
        "--iters", str(EXPECTED["iters"]), "--batch-size", str(EXPECTED["batch_size"]), "--order", "file",
        "--rank", str(EXPECTED["rank"]), "--layers", str(EXPECTED["layers"]), "--keys", EXPECTED["keys"],
    )  # fmt: skip
    return out, report


def test_sgd_losses_match_peft(trained):
    _, report = trained
    assert report["train_losses"] == pytest.approx(EXPECTED["train_losses"], abs=2e-3)
    assert report["adapter"] and report["trained_tokens"] > 0 and report["val_loss"] is None


def _engine_greedy(adapter: Path) -> list[int]:
    out = engine(
        "generate", "--model", str(GOLDEN / "model"), "--adapter", str(adapter),
        "--prompt-ids", ",".join(map(str, EXPECTED["prompt_ids"])), "--max-tokens", str(len(EXPECTED["greedy_ids"])),
        "--ignore-eos",
    )  # fmt: skip
    return out["token_ids"]


def test_the_saved_adapter_gives_peft_greedy_ids(trained):
    adapter, _ = trained
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_parameters"]["keys"] == [
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    assert _engine_greedy(adapter) == EXPECTED["greedy_ids"] != EXPECTED["base_greedy_ids"]


def test_mlx_lm_loads_the_adapter_and_generates_the_engines_ids(trained):
    adapter, _ = trained
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(GOLDEN / "model"), adapter_path=str(adapter))
    n = len(EXPECTED["greedy_ids"])
    ids = [
        int(token)
        for (token, _), _ in zip(generate_step(mx.array(EXPECTED["prompt_ids"]), model, max_tokens=n), range(n))
    ]
    assert ids == _engine_greedy(adapter) == EXPECTED["greedy_ids"]


def test_a_dora_adapter_gives_mlx_lm_the_engines_logits(tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    from engine.runtime.host import ModelHost
    from engine.training.adapters import AdapterSpec
    from engine.training.run import TrainRequest, run_training
    from engine.training.trainer import TrainSettings

    host = ModelHost()
    host.load(str(GOLDEN / "model"))
    request = TrainRequest(
        data=str(GOLDEN / "train.jsonl"),
        adapter_out=str(tmp_path / "dora"),
        spec=AdapterSpec(rank=4, layers=2, keys=["q_proj", "v_proj", "down_proj"], dora=True),
        settings=TrainSettings(iters=3, batch_size=2, lr=1e-2, order="file"),
    )
    report = run_training(host.model, host.tokenizer, host.template, request)
    host.mount_adapter(report.adapter, "dora")
    host.set_active_adapters({"dora": 1.0})
    ids = mx.array([EXPECTED["prompt_ids"]])
    ours = host.model(ids)
    model, _ = load(str(GOLDEN / "model"), adapter_path=report.adapter)
    theirs = model(ids)
    base = ModelHost()
    base.load(str(GOLDEN / "model"))
    assert mx.abs(ours - theirs).max().item() < 1e-4
    assert mx.abs(ours - base.model(ids)).max().item() > 1e-3  # the adapter changed the model
