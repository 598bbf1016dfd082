"""One training run on a loaded model, from data files to a saved adapter.

``run_training`` reads and tokenizes the data (bad rows reported through ``on_bad_row``,
never dropped silently), puts trainable adapters on the model (or starts from
``adapter_init``), plans the memory and refuses before any work when the budget cannot
hold it, trains, and saves the adapter in mlx-lm's format. The adapters are taken off
again afterwards (``remove_adapters``), so the model computes exactly what it did before;
the trained adapter is then mounted like any other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from engine.training.adapters import AdapterLayers, AdapterSpec, TrainingError, add_adapters, init_from, replace_module
from engine.training.data import BadRow, Encoder, data_files, load_rows
from engine.training.memory import check_plan, plan_training
from engine.training.trainer import StepReport, TrainReport, TrainSettings, train


@dataclass
class TrainRequest:
    data: str
    adapter_out: str
    adapter_init: str | None = None
    spec: AdapterSpec = field(default_factory=AdapterSpec)
    settings: TrainSettings = field(default_factory=TrainSettings)
    max_seq_len: int = 2048
    mask_prompt: bool = False
    base_model: str = ""


def encoder_for(tokenizer: Any, template: Any) -> Encoder:
    eos = None
    name = getattr(tokenizer, "eos_token", None)
    if name is not None:
        eos = tokenizer.backend.token_to_id(name)
    if eos is None and getattr(tokenizer, "eos_token_ids", None):
        eos = min(tokenizer.eos_token_ids)
    return Encoder(
        encode=lambda text: list(tokenizer.encode(text)),
        encode_rendered=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        render=template.render if template is not None else None,
        eos_id=eos,
    )


def remove_adapters(model: nn.Module, found: AdapterLayers) -> None:
    """Put each wrapped linear layer back where its adapter layer was."""
    blocks = list(model.layers)
    for path, layer in found.items():
        index, home = found.homes[path]
        replace_module(blocks[index], home, layer.linear)


def run_training(
    model: nn.Module,
    tokenizer: Any,
    template: Any,
    request: TrainRequest,
    *,
    budget: int = 0,
    on_step: Callable[[StepReport], None] | None = None,
    on_bad_row: Callable[[BadRow], None] | None = None,
    cancel: threading.Event | None = None,
) -> TrainReport:
    if request.max_seq_len < 2:
        raise TrainingError(f"--max-seq-len must be at least 2 (got {request.max_seq_len})")
    train_file, valid_file = data_files(request.data)
    enc = encoder_for(tokenizer, template)
    rows, bad, _ = load_rows(train_file, enc, mask_prompt=request.mask_prompt, max_seq_len=request.max_seq_len)
    valid, bad_valid, _ = (
        load_rows(valid_file, enc, mask_prompt=request.mask_prompt, max_seq_len=request.max_seq_len)
        if valid_file is not None
        else ([], [], 0)
    )
    for problem in [*bad, *bad_valid]:
        if on_bad_row is not None:
            on_bad_row(problem)
    if not rows:
        raise TrainingError(f"{train_file} has no row to train on ({len(bad)} bad rows, each reported above).")
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)
    if vocab and any(max(r.ids) >= vocab for r in rows):
        raise TrainingError(f"The data tokenizes to ids past the model's vocabulary of {vocab}; wrong tokenizer?")
    settings = request.settings
    found = add_adapters(model, request.spec)
    try:
        if request.adapter_init is not None:
            init_from(request.adapter_init, found, request.spec)
        longest = max(len(r.ids) for r in [*rows, *valid])
        plan = plan_training(
            model,
            batch_size=settings.batch_size,
            length=longest,
            optimizer=settings.optimizer,
            grad_checkpoint=settings.grad_checkpoint,
        )
        check_plan(
            plan, budget, batch_size=settings.batch_size, length=longest, grad_checkpoint=settings.grad_checkpoint
        )
        return train(
            model,
            found,
            request.spec,
            rows,
            valid,
            settings,
            adapter_out=request.adapter_out,
            base_model=request.base_model,
            on_step=on_step,
            cancel=cancel,
        )
    finally:
        remove_adapters(model, found)
        model.unfreeze()
