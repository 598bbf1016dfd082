"""Training a real model: stories260K (the TinyStories Llama in ../shared/data) on a
couple of hundred short stories lowers its validation loss, and the adapter it saves
mounts on the model and gives the loss training reported."""

from __future__ import annotations

import json

import pytest

from engine.cli.bench_train import write_data


@pytest.fixture(scope="module")
def stories(shared_data, tmp_path_factory):
    return shared_data / "tiny_llm" / "stories260K.gguf", write_data(tmp_path_factory.mktemp("stories"), 120)


@pytest.mark.slow
@pytest.mark.long
def test_training_lowers_validation_loss(stories, tmp_path):
    from engine.runtime.host import ModelHost
    from engine.training.adapters import AdapterSpec
    from engine.training.data import load_rows
    from engine.training.run import TrainRequest, encoder_for, run_training
    from engine.training.trainer import TrainSettings, evaluate

    model, data = stories
    host = ModelHost()
    host.load(str(model))
    settings = TrainSettings(iters=40, batch_size=4, lr=1e-3, save_every=0)
    request = TrainRequest(
        data=str(data), adapter_out=str(tmp_path / "a"), spec=AdapterSpec(layers=5), settings=settings
    )
    report = run_training(host.model, host.tokenizer, host.template, request)
    before, after = report.val_losses[0][1], report.val_loss
    assert after < 0.8 * before, report.val_losses
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["num_layers"] == 5
    host.mount_adapter(report.adapter, "stories")
    host.set_active_adapters({"stories": 1.0})
    rows, _, _ = load_rows(data / "valid.jsonl", encoder_for(host.tokenizer, host.template))
    assert evaluate(host.model, rows, 4) == pytest.approx(after, abs=1e-3)
