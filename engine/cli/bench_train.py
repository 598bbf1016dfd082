"""Training speed beside mlx-lm's: the same model, data and settings, in one run.

    python -m engine.cli.bench_train --model stories260K.gguf --tokenizer tok512.model
        [--iters 200] [--batch-size 4] [--lr 1e-3] [--rows 300] [--out DIR]

It writes a dataset of short stories (``story_rows``: a few hundred rows built from
fixed word lists by a seeded generator, train and valid), trains a LoRA adapter with the
engine (``run_training``), then runs ``python -m mlx_lm lora`` on the same rows with the
same rank, scale, layers, keys, optimizer, learning rate, batch size and iterations on
the model written as a Hugging Face folder (the engine's weights, the SentencePiece
tokenizer beside them) with mlx-lm's own trainer (what ``mlx_lm lora --train`` runs), and
prints for each: seconds, trained tokens per second, peak memory, validation loss before
and after (each trainer's own figure, and the engine's loss over both adapters).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAMES = ["Lily", "Tom", "Ben", "Mia", "Sue", "Max", "Anna", "Tim", "Sara", "Jack"]
ANIMALS = ["cat", "dog", "bird", "frog", "bunny", "duck", "bear", "fish"]
PLACES = ["park", "garden", "forest", "house", "school", "river", "beach", "yard"]
THINGS = ["ball", "kite", "box", "toy", "cake", "hat", "flower", "book"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud"]


def story_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` short stories in TinyStories' manner, the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
        thing, feeling = rng.choice(THINGS), rng.choice(FEELINGS)
        rows.append(
            {
                "text": f"Once upon a time, there was a little {animal} named {name}. {name} liked to play in the "
                f"{place}. One day, {name} found a big {thing}. {name} was very {feeling}. "
                f"{name} took the {thing} home and played with it all day."
            }
        )
    return rows


def write_data(folder: Path, rows: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", rows, 1), ("valid", max(20, rows // 6), 2)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in story_rows(n, seed)))
    return folder


def engine_run(model: str, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from engine.runtime.host import ModelHost
    from engine.training.adapters import AdapterSpec
    from engine.training.run import TrainRequest, run_training
    from engine.training.trainer import TrainSettings

    host = ModelHost()
    host.load(model)
    layers = len(host.model.layers)
    settings = TrainSettings(
        iters=args.iters, batch_size=args.batch_size, lr=args.lr, optimizer="adam", order="shuffle", save_every=0
    )
    request = TrainRequest(
        data=str(data), adapter_out=str(out), spec=AdapterSpec(rank=8, scale=20.0, layers=layers), settings=settings
    )
    started, cpu = time.perf_counter(), time.process_time()
    report = run_training(host.model, host.tokenizer, host.template, request)
    return {
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
        "trained_tokens": report.trained_tokens,
        "tokens_per_second": report.tokens_per_second,
        "peak_memory_bytes": report.peak_memory_bytes,
        "val_before": report.val_losses[0][1],
        "val_after": report.val_loss,
        "layers": layers,
        "host": host,
    }


def hf_folder(host: Any, tokenizer_model: Path, folder: Path) -> Path:
    """The loaded llama as a Hugging Face folder mlx-lm reads (weights as the engine holds them)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    a = host.model.args
    weights = dict(tree_flatten(host.model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": 2048, "tie_word_embeddings": "lm_head.weight" not in weights,
        "head_dim": a.hidden_size // a.num_attention_heads, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    tok = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    return folder


def mlx_lm_run(model: Path, data: Path, out: Path, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """mlx-lm's own trainer (what ``mlx_lm lora --train`` runs), set up as its command does."""
    import types

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    reports: dict[str, Any] = {"val": []}

    class Listen(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            reports["train"] = info

        def on_val_loss_report(self, info: dict) -> None:
            reports["val"].append(info["val_loss"])

    net, tokenizer = load(str(model))
    net.freeze()
    keys = ["self_attn.q_proj", "self_attn.v_proj"]
    linear_to_lora_layers(net, layers, {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": keys})
    options = types.SimpleNamespace(data=str(data), train=True, test=False, hf_dataset=False, mask_prompt=False)
    train_set, valid_set, _ = load_dataset(options, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    settings = TrainingArgs(
        batch_size=args.batch_size, iters=args.iters, val_batches=-1, steps_per_report=args.iters,
        steps_per_eval=args.iters, steps_per_save=args.iters, adapter_file=str(out / "adapters.safetensors"),
    )  # fmt: skip
    mx.reset_peak_memory()
    started, cpu = time.perf_counter(), time.process_time()
    train(net, optim.Adam(learning_rate=args.lr), CacheDataset(train_set), CacheDataset(valid_set), args=settings,
          training_callback=Listen())  # fmt: skip
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    config = {"fine_tune_type": "lora", "num_layers": layers,
              "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": keys}}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "trained_tokens": int(reports["train"]["trained_tokens"]),
        "tokens_per_second": reports["train"]["tokens_per_second"],
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "val_before": reports["val"][0] if reports["val"] else None,
        "val_after": reports["val"][-1] if reports["val"] else None,
    }


def adapter_val_loss(host: Any, adapter: Path, data: Path) -> float:
    from engine.training.data import load_rows
    from engine.training.run import encoder_for
    from engine.training.trainer import evaluate

    rows, _, _ = load_rows(data / "valid.jsonl", encoder_for(host.tokenizer, host.template))
    host.mount_adapter(str(adapter), "mlx-lm")
    host.set_active_adapters({"mlx-lm": 1.0})
    try:
        return evaluate(host.model, rows, 4)
    finally:
        host.unmount_adapter("mlx-lm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_train", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", required=True, help="the model's SentencePiece tokenizer.model, for mlx-lm")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--out", help="keep the data and adapters here")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp())
    data = write_data(root / "data", args.rows)
    ours = engine_run(args.model, data, root / "engine_adapter", args)
    host = ours.pop("host")
    folder = hf_folder(host, Path(args.tokenizer), root / "hf_model")
    theirs = mlx_lm_run(folder, data, root / "mlx_lm_adapter", ours["layers"], args)
    # mlx-lm's own validation figure counts one padding token per row as a target; the
    # engine's loss (padding excluded) over its adapter compares like with like.
    theirs["val_after_engine_loss"] = adapter_val_loss(host, root / "mlx_lm_adapter", data)
    ours["val_after_engine_loss"] = ours["val_after"]
    print(
        f"{'':8} {'seconds':>8} {'tok/s':>7} {'peak MB':>8} {'val before':>10} {'val after':>9} {'(engine loss)':>13}"
    )
    for name, r in (("engine", ours), ("mlx-lm", theirs)):
        print(
            f"{name:8} {r['seconds']:8.1f} {r['tokens_per_second']:7.0f} {r['peak_memory_bytes'] / 1e6:8.1f} "
            f"{r['val_before']:10.4f} {r['val_after']:9.4f} {r['val_after_engine_loss']:13.4f}"
        )
    print(json.dumps({"engine": {k: v for k, v in ours.items()}, "mlx_lm": theirs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
