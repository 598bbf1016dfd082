"""The trainer's parts on the tiny golden training model: mlx-lm's four data shapes and
which tokens they train, bad rows by line number, batch order, DoRA and quantized bases,
gradient checkpointing and accumulation, the memory plan's refusal, and the adapter
taken off the model afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.runtime.host import ModelHost
from engine.training.adapters import AdapterSpec, TrainingError
from engine.training.data import batches, load_rows
from engine.training.memory import check_plan, plan_training
from engine.training.run import TrainRequest, encoder_for, run_training
from engine.training.trainer import TrainSettings

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "training"


@pytest.fixture(scope="module")
def host() -> ModelHost:
    h = ModelHost()
    h.load(str(GOLDEN / "model"))
    return h


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_four_shapes_and_their_targets(host, tmp_path):
    enc = encoder_for(host.tokenizer, host.template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    data = write_rows(
        tmp_path / "d.jsonl",
        [
            {"text": "hello there"},
            {"prompt": "hello", "completion": "there"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "tools": tools},
        ],
    )
    rows, bad, _ = load_rows(data, enc)
    assert not bad and len(rows) == 4
    eos = host.tokenizer.backend.token_to_id("<|im_end|>")
    assert rows[0].ids == host.tokenizer.encode("hello there") + [eos]
    assert all(r.targets[0] is False and all(r.targets[1:]) for r in rows)
    masked, _, _ = load_rows(data, enc, mask_prompt=True)
    prompt = host.template.render([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    head = len(host.tokenizer.encode(prompt, add_special_tokens=False))
    assert masked[1].targets == [i >= head for i in range(len(masked[1].ids))]
    trained = host.tokenizer.decode([t for t, keep in zip(masked[2].ids, masked[2].targets) if keep])
    assert trained.startswith("hello") and "user" not in trained  # only the assistant turn


def test_bad_rows_are_reported_by_line_number(host, tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"text": "fine row"}, "{not json", {"foo": 1}, "", {"text": 5}])
    rows, bad, _ = load_rows(data, encoder_for(host.tokenizer, host.template))
    assert [r.line for r in rows] == [1]
    assert [(b.line, b.reason.split(" ")[0]) for b in bad] == [(2, "not"), (3, "unknown"), (5, "'text'")]
    assert str(bad[0]).startswith("d.jsonl line 2: not JSON")


def test_batch_orders(host, tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(5)])
    rows, _, _ = load_rows(data, encoder_for(host.tokenizer, host.template))
    file_order = batches(rows, 2, "file", 0)
    assert [[r.line for r in next(file_order)] for _ in range(3)] == [[1, 2], [3, 4], [5, 1]]
    first = [[r.line for r in b] for b, _ in zip(batches(rows, 2, "shuffle", 7), range(5))]
    again = [[r.line for r in b] for b, _ in zip(batches(rows, 2, "shuffle", 7), range(5))]
    other = [[r.line for r in b] for b, _ in zip(batches(rows, 2, "shuffle", 8), range(5))]
    assert first == again != other
    assert sorted(sum(first[:3], [])) == [1, 2, 3, 4, 5]  # each pass takes every row once


def _run(host, tmp_path, **kw) -> object:
    spec = kw.pop("spec", AdapterSpec(rank=4, layers=2))
    settings = TrainSettings(**{"iters": 3, "batch_size": 2, "lr": 1e-3, "order": "file", **kw})
    request = TrainRequest(
        data=str(GOLDEN / "train.jsonl"), adapter_out=str(tmp_path / "out"), spec=spec, settings=settings
    )
    mx.random.seed(0)
    return run_training(host.model, host.tokenizer, host.template, request)


def test_checkpointing_changes_memory_not_losses_and_the_model_is_given_back(host, tmp_path):
    before = host.model(mx.array([[5, 6, 7]]))
    plain = _run(host, tmp_path)
    checkpointed = _run(host, tmp_path, grad_checkpoint=True)
    assert checkpointed.train_losses == pytest.approx(plain.train_losses, abs=1e-5)
    assert mx.allclose(host.model(mx.array([[5, 6, 7]])), before).item()  # adapters taken off again
    assert not any(isinstance(m, nn.Module) and hasattr(m, "lora_a") for _, m in host.model.named_modules())


def test_accumulating_two_batches_of_one_averages_their_gradients(host, tmp_path):
    whole = _run(host, tmp_path, optimizer="sgd")
    halves = _run(host, tmp_path, optimizer="sgd", grad_accumulation=2, batch_size=1)
    # Same rows per update; per-batch means averaged instead of one mean over the tokens.
    assert halves.train_losses[0] == pytest.approx(whole.train_losses[0], abs=0.05)
    assert halves.train_losses[-1] < halves.train_losses[0]


def test_dora_trains_and_mounts(host, tmp_path):
    report = _run(host, tmp_path, spec=AdapterSpec(rank=4, layers=1, keys=["q_proj", "o_proj"], dora=True))
    config = json.loads((Path(report.adapter) / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "dora" and config["lora_parameters"]["keys"] == [
        "self_attn.o_proj",
        "self_attn.q_proj",
    ]
    info = host.mount_adapter(report.adapter, "dora")
    assert info.kind == "dora" and info.targets == 2
    host.unmount_adapter("dora")


def test_a_quantized_base_trains(tmp_path):
    h = ModelHost()
    h.load(str(GOLDEN / "model"))
    nn.quantize(h.model, group_size=32, bits=4)
    report = _run(h, tmp_path)
    assert report.train_losses[-1] < report.train_losses[0]
    assert isinstance(h.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_the_memory_plan_refuses_with_numbers(host):
    from engine.training.adapters import add_adapters
    from engine.training.run import remove_adapters

    found = add_adapters(host.model, AdapterSpec(rank=4, layers=2))
    try:
        plan = plan_training(host.model, batch_size=8, length=2048, optimizer="adam", grad_checkpoint=False)
        lean = plan_training(host.model, batch_size=8, length=2048, optimizer="adam", grad_checkpoint=True)
    finally:
        remove_adapters(host.model, found)
    assert lean.activation_bytes < plan.activation_bytes
    with pytest.raises(TrainingError) as e:
        check_plan(plan, plan.total_bytes - 1, batch_size=8, length=2048, grad_checkpoint=False)
    message = str(e.value)
    assert "weights" in message and "activations" in message and "--grad-checkpoint" in message
    assert "--batch-size 4" in message and "\n" not in message
    check_plan(plan, plan.total_bytes, batch_size=8, length=2048, grad_checkpoint=False)


def test_warm_up_rises_linearly_then_holds():
    from engine.training.trainer import make_optimizer

    opt = make_optimizer(TrainSettings(lr=1e-2, warmup=4, optimizer="adamw"))
    schedule = opt._schedulers["learning_rate"]
    rates = [float(schedule(mx.array(step))) for step in range(7)]
    assert rates[0] == 0.0 and rates[2] == pytest.approx(5e-3) and rates[4:] == pytest.approx([1e-2] * 3)
    with pytest.raises(TrainingError, match="--optimizer must be one of"):
        make_optimizer(TrainSettings(optimizer="lion"))


def test_a_folder_of_text_files_trains_one_row_per_paragraph(host, tmp_path):
    from engine.training.data import data_files

    (tmp_path / "a.md").write_text("# the fox\n\nthe quick brown fox\njumps over the dog\n\n\n")
    (tmp_path / "b.txt").write_text("hello there how are you")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    train, valid = data_files(tmp_path)
    rows, bad, _ = load_rows(train, encoder_for(host.tokenizer, host.template))
    assert valid is None and not bad
    texts = [host.tokenizer.decode(r.ids[:-1]) for r in rows]
    assert texts == ["# the fox", "the quick brown fox\njumps over the dog", "hello there how are you"]


def test_training_under_mounted_adapters_leaves_them_in_place(tmp_path):
    h = ModelHost()
    h.load(str(GOLDEN / "model"))
    h.mount_adapter(str(GOLDEN / "init_adapter"), "peft")
    h.set_active_adapters({"peft": 1.0})
    x = mx.array([[5, 6, 7]])
    with_peft = h.model(x)
    h.set_active_adapters({})  # as the worker does while training
    report = _run(h, tmp_path)
    assert report.train_losses[-1] < report.train_losses[0]
    h.set_active_adapters({"peft": 1.0})
    assert mx.allclose(h.model(x), with_peft).item()
    h.mount_adapter(report.adapter, "new")  # the trained adapter targets the same layers
    assert {a.name for a in h.adapters()} == {"peft", "new"}
