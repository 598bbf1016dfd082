"""``python -m engine train``: LoRA / DoRA fine-tuning of a model on a .jsonl dataset.

    python -m engine train --model PATH --data FILE.jsonl|DIR --adapter-out DIR [--adapter-init DIR]
        [--iters N] [--batch-size B] [--lr LR] [--optimizer adam|adamw|sgd] [--rank R] [--scale S]
        [--layers N] [--keys q_proj,v_proj] [--order file|shuffle] [--seed S] [--max-seq-len N]
        [--grad-checkpoint] [--mask-prompt] [--json]
        [--dora] [--warmup N] [--grad-accumulation N] [--steps-per-eval N] [--save-every N]
        [--memory-budget SIZE]

Progress goes to stderr (one line per iteration: loss, tokens/s, peak memory), bad data
rows to stderr with their line numbers. ``--json`` prints one object as the last line of
stdout: ``train_losses`` (one per iteration, before its update), ``val_loss``,
``val_losses``, ``trained_tokens``, ``adapter``, ``seconds``, ``tokens_per_second``,
``peak_memory_bytes``, ``skipped_rows``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _budget(text: str) -> int:
    from engine.errors import EngineError
    from engine.runtime.memory import parse_budget

    try:
        return parse_budget(text)
    except EngineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="LoRA / DoRA fine-tuning on a .jsonl dataset")
    p.add_argument("--model", required=True, help="model folder, cached Hugging Face repo id, or .gguf file")
    p.add_argument("--data", required=True, help="a .jsonl file, or a folder with train.jsonl (and valid.jsonl)")
    p.add_argument("--adapter-out", required=True, help="folder the adapter is written to (mlx-lm's format)")
    p.add_argument("--adapter-init", help="start from this adapter (mlx-lm or PEFT folder)")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scale", type=float, default=20.0)
    p.add_argument("--layers", type=int, default=16, help="adapt the last N blocks")
    p.add_argument("--keys", default="q_proj,v_proj", help="linear layers to adapt in each block")
    p.add_argument("--dora", action="store_true", help="train a DoRA adapter instead of LoRA")
    p.add_argument("--order", choices=["file", "shuffle"], default="shuffle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations: less memory, slower")
    p.add_argument("--grad-accumulation", type=int, default=1, help="batches per update")
    p.add_argument("--warmup", type=int, default=0, help="iterations of linear learning-rate warm-up")
    p.add_argument("--mask-prompt", action="store_true", help="train only on completions / assistant turns")
    p.add_argument("--steps-per-eval", type=int, default=0, help="validate every N iterations (0: first and last)")
    p.add_argument("--save-every", type=int, default=100, help="save the adapter every N iterations")
    p.add_argument("--memory-budget", type=_budget, help="refuse a run that does not fit, e.g. 8GB")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_train(args: argparse.Namespace) -> int:
    from engine.runtime.host import ModelHost
    from engine.runtime.memory import default_budget
    from engine.training.adapters import AdapterSpec
    from engine.training.run import TrainRequest, run_training
    from engine.training.trainer import TrainSettings

    spec = AdapterSpec(
        rank=args.rank,
        scale=args.scale,
        layers=args.layers,
        keys=[k.strip() for k in args.keys.split(",") if k.strip()],
        dora=args.dora,
    )
    settings = TrainSettings(
        iters=args.iters,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        warmup=args.warmup,
        grad_accumulation=args.grad_accumulation,
        grad_checkpoint=args.grad_checkpoint,
        order=args.order,
        seed=args.seed,
        steps_per_eval=args.steps_per_eval,
        save_every=args.save_every,
    )
    host = ModelHost()
    host.load(args.model, budget=args.memory_budget)
    skipped: list[str] = []

    def bad_row(problem: Any) -> None:
        skipped.append(str(problem))
        print(f"skipped {problem}", file=sys.stderr, flush=True)

    def step(report: Any) -> None:
        if report.loss is not None:
            print(
                f"iter {report.iteration}/{report.iters}  loss {report.loss:.4f}  "
                f"{report.tokens_per_second:.0f} tok/s  peak {report.peak_memory_bytes / 1e6:.0f} MB",
                file=sys.stderr,
                flush=True,
            )
        elif report.val_loss is not None:
            print(f"iter {report.iteration}: validation loss {report.val_loss:.4f}", file=sys.stderr, flush=True)

    request = TrainRequest(
        data=args.data,
        adapter_out=args.adapter_out,
        adapter_init=args.adapter_init,
        spec=spec,
        settings=settings,
        max_seq_len=args.max_seq_len,
        mask_prompt=args.mask_prompt,
        base_model=host.info.name,
    )
    budget = args.memory_budget if args.memory_budget is not None else default_budget()[0]
    report = run_training(
        host.model, host.tokenizer, host.template, request, budget=budget, on_step=step, on_bad_row=bad_row
    )
    if args.json:
        out = {
            "train_losses": report.train_losses,
            "val_loss": report.val_loss,
            "val_losses": report.val_losses,
            "trained_tokens": report.trained_tokens,
            "adapter": report.adapter,
            "seconds": report.seconds,
            "tokens_per_second": report.tokens_per_second,
            "peak_memory_bytes": report.peak_memory_bytes,
            "skipped_rows": skipped,
        }
        print(json.dumps(out))
    else:
        print(f"adapter saved to {report.adapter}")
    return 0
