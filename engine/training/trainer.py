"""The training loop: batches in, one optimizer update per iteration, the adapter saved.

Loss is mlx-lm's default: the mean cross-entropy over the predicted tokens of the batch,
padding and masked (prompt) tokens excluded. Each iteration feeds ``grad_accumulation``
batches, averages their gradients and updates once; the loss it records is the mean of
those batches' losses, computed before the update (``train_losses``). The learning rate
rises linearly from 0 over ``warmup`` iterations, then stays. ``grad_checkpoint``
recomputes each block's activations in the backward pass instead of keeping them.

``on_step(StepReport)`` hears of every iteration (and of each validation), and a set
``cancel`` stops between iterations: the adapter trained so far is saved and the report
says ``stopped``. The adapter is also saved every ``save_every`` iterations, so a crash
loses at most that much.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from engine.training.adapters import AdapterSpec, TrainingError, save_adapter
from engine.training.data import Row, batches

OPTIMIZERS = ("adam", "adamw", "sgd")
PAD_TO = 32


@dataclass
class TrainSettings:
    iters: int = 1000
    batch_size: int = 4
    lr: float = 1e-5
    optimizer: str = "adam"
    warmup: int = 0
    grad_accumulation: int = 1
    grad_checkpoint: bool = False
    order: str = "shuffle"
    seed: int = 0
    steps_per_eval: int = 0  # 0: validate only before and after
    save_every: int = 100
    compile: bool = True  # trace the step once per padded batch width (PAD_TO keeps those few)


@dataclass
class StepReport:
    iteration: int
    iters: int
    loss: float | None  # this iteration's train loss (None for a validation report)
    val_loss: float | None = None
    tokens: int = 0  # trained tokens so far
    tokens_per_second: float = 0.0  # trained tokens over the seconds spent in training steps
    seconds: float = 0.0  # since the start, validation and saves included
    peak_memory_bytes: int = 0


@dataclass
class TrainReport:
    train_losses: list[float]
    val_loss: float | None
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (iteration, loss), iteration 0 first
    trained_tokens: int = 0
    adapter: str = ""
    seconds: float = 0.0  # the whole run: validation, saves and the final write included
    step_seconds: float = 0.0  # the training steps alone (batching, gradient, update)
    tokens_per_second: float = 0.0  # trained_tokens / step_seconds, as mlx-lm's trainer counts it
    peak_memory_bytes: int = 0
    stopped: bool = False


def make_optimizer(settings: TrainSettings) -> optim.Optimizer:
    if settings.optimizer not in OPTIMIZERS:
        raise TrainingError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {settings.optimizer})")
    if not settings.lr > 0:
        raise TrainingError(f"--lr must be positive (got {settings.lr})")
    lr: Any = settings.lr
    if settings.warmup > 0:
        ramp = optim.linear_schedule(0.0, settings.lr, settings.warmup)
        lr = optim.join_schedules([ramp, lambda _: mx.array(settings.lr)], [settings.warmup])
    if settings.optimizer == "sgd":
        return optim.SGD(learning_rate=lr)
    if settings.optimizer == "adamw":
        return optim.AdamW(learning_rate=lr)
    return optim.Adam(learning_rate=lr)


def pack(rows: Sequence[Row]) -> tuple[mx.array, mx.array, mx.array]:
    """(inputs, targets, mask) for a batch, right-padded to one past a multiple of PAD_TO
    (so a compiled step meets few shapes; padding is masked out of the loss)."""
    longest = max(len(r.ids) for r in rows)
    width = 1 + PAD_TO * ((longest - 1 + PAD_TO - 1) // PAD_TO)
    ids = [r.ids + [0] * (width - len(r.ids)) for r in rows]
    keep = [[1.0 if t else 0.0 for t in r.targets] + [0.0] * (width - len(r.ids)) for r in rows]
    batch = mx.array(ids, dtype=mx.int32)
    return batch[:, :-1], batch[:, 1:], mx.array(keep)[:, 1:]


def batch_loss(model: nn.Module, inputs: mx.array, targets: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """(mean cross-entropy over the masked-in tokens, how many there are)."""
    logits = model(inputs).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, targets) * mask
    count = mask.sum()
    return ce.sum() / count, count


def evaluate(model: nn.Module, rows: Sequence[Row], batch_size: int) -> float:
    """The token-weighted mean loss over every row (in order, batches of ``batch_size``)."""
    total, count = 0.0, 0.0
    for start in range(0, len(rows), batch_size):
        loss, n = batch_loss(model, *pack(rows[start : start + batch_size]))
        mx.eval(loss, n)
        total += loss.item() * n.item()
        count += n.item()
    return total / max(count, 1.0)


@contextmanager
def checkpointed_blocks(model: nn.Module, on: bool) -> Iterator[None]:
    """While training with ``on``, each block's activations are recomputed in the backward
    pass (mx.checkpoint); the block class is given back its own call afterwards."""
    if not on:
        yield
        return
    kind = type(model.layers[0])
    original = kind.__call__

    def call(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        def inner(params: Any, *args: Any, **kwargs: Any) -> Any:
            block.update(params)
            return original(block, *args, **kwargs)

        return mx.checkpoint(inner)(block.trainable_parameters(), *args, **kwargs)

    kind.__call__ = call
    try:
        yield
    finally:
        kind.__call__ = original


def train(
    model: nn.Module,
    found: dict[str, nn.Module],
    spec: AdapterSpec,
    train_rows: Sequence[Row],
    valid_rows: Sequence[Row],
    settings: TrainSettings,
    *,
    adapter_out: str,
    base_model: str,
    on_step: Callable[[StepReport], None] | None = None,
    cancel: threading.Event | None = None,
) -> TrainReport:
    if settings.iters < 1 or settings.batch_size < 1 or settings.grad_accumulation < 1:
        raise TrainingError("--iters, --batch-size and --grad-accumulation must each be at least 1")
    optimizer = make_optimizer(settings)
    loss_and_grad = nn.value_and_grad(model, batch_loss)
    state = [model.state, optimizer.state]

    def micro_step(inputs: mx.array, targets: mx.array, mask: mx.array) -> tuple[mx.array, mx.array, Any]:
        (loss, count), grads = loss_and_grad(model, inputs, targets, mask)
        return loss, count, grads

    def update(grads: Any) -> None:
        optimizer.update(model, grads)

    def whole_step(inputs: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
        """One batch per update: gradient and update in one traced function, as mlx-lm's
        step (returning the gradients to apply them apart costs twice the time)."""
        (loss, _), grads = loss_and_grad(model, inputs, targets, mask)
        optimizer.update(model, grads)
        return loss

    if settings.compile:
        micro_step = mx.compile(micro_step, inputs=state, outputs=state)
        update = mx.compile(update, inputs=state, outputs=state)
        whole_step = mx.compile(whole_step, inputs=state, outputs=state)

    report = TrainReport(train_losses=[], val_loss=None)
    stream = batches(train_rows, settings.batch_size, settings.order, settings.seed)
    started = time.perf_counter()
    mx.reset_peak_memory()
    model.train()
    with checkpointed_blocks(model, settings.grad_checkpoint):
        if valid_rows:
            report.val_losses.append((0, evaluate(model, valid_rows, settings.batch_size)))
            _tell(on_step, report, 0, settings, None, started)
        for iteration in range(1, settings.iters + 1):
            if cancel is not None and cancel.is_set():
                report.stopped = True
                break
            step_started = time.perf_counter()
            losses, total = [], None
            for _ in range(settings.grad_accumulation):
                rows = next(stream)
                report.trained_tokens += sum(sum(r.targets) for r in rows)
                if settings.grad_accumulation == 1:
                    losses.append(whole_step(*pack(rows)))
                    break
                loss, count, grads = micro_step(*pack(rows))
                total = grads if total is None else tree_map(mx.add, total, grads)
                losses.append(loss)
            if total is not None:
                update(tree_map(lambda g: g / settings.grad_accumulation, total))
            mx.eval(state, losses)
            report.train_losses.append(sum(x.item() for x in losses) / len(losses))
            report.step_seconds += time.perf_counter() - step_started
            if valid_rows and settings.steps_per_eval and iteration % settings.steps_per_eval == 0:
                report.val_losses.append((iteration, evaluate(model, valid_rows, settings.batch_size)))
            _tell(on_step, report, iteration, settings, report.train_losses[-1], started)
            if settings.save_every and iteration % settings.save_every == 0 and iteration < settings.iters:
                save_adapter(adapter_out, found, spec, base_model)
        done = len(report.train_losses)
        if valid_rows and (not report.val_losses or report.val_losses[-1][0] != done):
            report.val_losses.append((done, evaluate(model, valid_rows, settings.batch_size)))
            _tell(on_step, report, done, settings, None, started)
    model.eval()
    report.val_loss = report.val_losses[-1][1] if report.val_losses else None
    report.adapter = str(save_adapter(adapter_out, found, spec, base_model))
    report.seconds = time.perf_counter() - started
    report.tokens_per_second = _rate(report)
    report.peak_memory_bytes = int(mx.get_peak_memory())
    return report


def _tell(
    on_step: Callable[[StepReport], None] | None,
    report: TrainReport,
    iteration: int,
    settings: TrainSettings,
    loss: float | None,
    started: float,
) -> None:
    if on_step is None:
        return
    seconds = time.perf_counter() - started
    on_step(
        StepReport(
            iteration=iteration,
            iters=settings.iters,
            loss=loss,
            val_loss=report.val_losses[-1][1] if loss is None and report.val_losses else None,
            tokens=report.trained_tokens,
            tokens_per_second=_rate(report),
            seconds=seconds,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
    )


def _rate(report: TrainReport) -> float:
    """Trained tokens a second of training steps. Validation and saves are left out, as
    mlx-lm's trainer leaves them out of its figure, so the two compare like with like; the
    run's whole time is ``seconds``."""
    return report.trained_tokens / report.step_seconds if report.step_seconds > 0 else 0.0
