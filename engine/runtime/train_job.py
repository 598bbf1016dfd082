"""A ``Train`` request on the worker: the loaded model trained in place, between requests.

Training runs on the thread that owns MLX, instead of other requests: the worker takes
nothing else until it ends (a chat sent meanwhile waits in the queue and runs after).
Each iteration is a TrainProgress event; a Cancel stops between iterations, and the
adapter trained so far is saved (``TrainResult.stopped``). The model's own weights are
never changed, so chats' cached prefixes stay valid; adapters already mounted stay
mounted but off while it trains (and on again after), and the new adapter is mounted
like any other afterwards. ``adapter_init`` continues from a saved adapter (a stopped
run's, say).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from engine.api import Train, TrainProgress, TrainResult


def run_train(host: Any, command: Train, rid: int, cancel: threading.Event, emit: Callable[[Any], None]) -> TrainResult:
    from engine.runtime.memory import default_budget
    from engine.training.adapters import AdapterSpec
    from engine.training.run import TrainRequest, run_training
    from engine.training.trainer import TrainSettings

    plan = host.info.plan
    budget = plan.budget_bytes if plan is not None else default_budget()[0]
    skipped: list[str] = []
    first = [True]

    def on_step(report: Any) -> None:
        event = TrainProgress(
            request_id=rid,
            iteration=report.iteration,
            iters=report.iters,
            loss=report.loss,
            val_loss=report.val_loss,
            tokens_per_second=report.tokens_per_second,
            seconds=report.seconds,
            peak_memory_bytes=report.peak_memory_bytes,
            skipped_rows=list(skipped) if first[0] else [],
        )
        first[0] = False
        emit(event)

    request = TrainRequest(
        data=command.data,
        adapter_out=command.adapter_out,
        adapter_init=command.adapter_init,
        spec=AdapterSpec(rank=command.rank, scale=command.scale, layers=command.layers, keys=list(command.keys)),
        settings=TrainSettings(
            iters=command.iters,
            batch_size=command.batch_size,
            lr=command.lr,
            optimizer=command.optimizer,
            grad_checkpoint=command.grad_checkpoint,
            steps_per_eval=command.steps_per_eval,
            save_every=command.save_every,
            seed=command.seed,
        ),
        mask_prompt=command.mask_prompt,
        base_model=host.info.name,
    )
    # Mounted adapters stay mounted but off while the new one trains on the bare model.
    active = host.active_adapters()
    host.set_active_adapters({})
    try:
        report = run_training(
            host.model,
            host.tokenizer,
            host.template,
            request,
            budget=budget,
            on_step=on_step,
            on_bad_row=lambda bad: skipped.append(str(bad)),
            cancel=cancel,
        )
    finally:
        host.set_active_adapters(active)
    return TrainResult(
        adapter=report.adapter,
        train_losses=report.train_losses,
        val_loss=report.val_loss,
        trained_tokens=report.trained_tokens,
        seconds=report.seconds,
        stopped=report.stopped,
        skipped_rows=skipped,
    )
