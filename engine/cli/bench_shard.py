"""``python -m engine.cli.bench_shard``: sharded decoding speed against mlx-lm's pipeline.

Writes one random-weight Qwen2-layout folder (float32, one safetensors file per layer
under an index, a word-level tokenizer), then for each rank count times, in one run and
on the very same files:

- ours: 1 rank = the engine in this process; N ranks = ``RankGroup`` (local processes,
  ring over loopback), pipeline split, rank 0's reported prompt and generation tok/s;
- mlx-lm: 1 rank = ``mlx_lm.load`` in a child; N ranks = ``mlx_lm.utils.sharded_load``
  with a pipeline group in N local processes (the same environment), timing
  ``generate_step`` on rank 0.

Each is a warm-up then ``--repeat`` timed runs (best kept). CPU numbers compare loops on
one machine, where the ranks share its cores; they say nothing absolute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = dict(
    model_type="qwen2",
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=768,
    vocab_size=2048,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    torch_dtype="float32",
)


def write_folder(folder: Path, seed: int = 0) -> Path:
    """The random-weight checkpoint, laid out as the Hub ships Qwen2 (biases on q/k/v)."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    c = SHAPE
    h, n_layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv, inter = c["num_key_value_heads"] * d, c["intermediate_size"]
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weight_map: dict[str, str] = {}

    def save(name: str, tensors: dict[str, np.ndarray]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    save("model-rest.safetensors", {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32), "lm_head.weight": w(v, h)})  # fmt: skip
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": np.ones(h, np.float32)}
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        for name, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            tensors[p + f"self_attn.{name}.weight"], tensors[p + f"self_attn.{name}.bias"] = w(rows, h), w(rows)
        tensors[p + "self_attn.o_proj.weight"] = w(h, h)
        tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"] = w(inter, h), w(inter, h)
        tensors[p + "mlp.down_proj.weight"] = w(h, inter)
        save(f"model-layer{i:03d}.safetensors", tensors)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**c, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 0}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(v)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _prompt(n: int) -> list[int]:
    return [3 + (i * 7) % 2000 for i in range(n)]


# ---- ours --------------------------------------------------------------------------------


def ours(folder: Path, ranks: int, p: int, g: int, repeat: int) -> dict[str, float]:
    from engine.api import GenerationParams

    params = GenerationParams(max_tokens=g, ignore_eos=True)
    if ranks == 1:
        from engine.runtime.host import ModelHost

        host = ModelHost()
        host.load(str(folder))
        runs = [host.generate_ids(_prompt(p), params, session_id=str(i)).stats for i in range(repeat + 1)]
        return _best([{"prompt_tps": s.prompt_tps, "generation_tps": s.generation_tps} for s in runs[1:]])
    from engine.runtime.shard_group import RankGroup

    group = RankGroup(["127.0.0.1"] * ranks, ["--model", str(folder), "--shard", "pipeline"])
    group.start()
    try:
        group.wait_ready()
        results = []
        for i in range(repeat + 1):
            cmd = {"op": "generate_ids", "ids": _prompt(p), "params": dataclasses.asdict(params), "session": str(i)}
            results.append([e for e in group.run(cmd) if "result" in e][0]["result"])
    finally:
        group.close()
    return _best([{k: r[k] for k in ("prompt_tps", "generation_tps")} for r in results[1:]])


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    return max(runs, key=lambda r: r["generation_tps"])


# ---- mlx-lm ------------------------------------------------------------------------------


def theirs(folder: Path, ranks: int, p: int, g: int, repeat: int) -> dict[str, float]:
    """mlx-lm in ``ranks`` local processes started as mlx.launch starts them (ring)."""
    import socket

    ports = []
    for _ in range(ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], f)
    args = [sys.executable, "-m", "engine.cli.bench_shard", "--worker", str(folder), str(p), str(g), str(repeat)]
    env = dict(os.environ, MLX_HOSTFILE=f.name) if ranks > 1 else dict(os.environ)
    procs = [subprocess.Popen(args, env=dict(env, MLX_RANK=str(r)), stdout=subprocess.PIPE) for r in range(ranks)]
    outs = [proc.communicate(timeout=600)[0] for proc in procs]
    os.unlink(f.name)
    return json.loads(outs[0].decode().strip().splitlines()[-1])


def worker(folder: str, p: int, g: int, repeat: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load, sharded_load

    group = mx.distributed.init()
    model = sharded_load(folder, pipeline_group=group)[0] if group.size() > 1 else load(folder)[0]
    runs = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        first = None
        for _tok in generate_step(mx.array(_prompt(p)), model, max_tokens=g):  # run to its end: no step left queued
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        runs.append({"prompt_tps": p / (first - start), "generation_tps": (g - 1) / (end - first)})
    if group.rank() == 0:
        print(json.dumps(_best(runs[1:])), flush=True)
    # No rank leaves before all are done (a rank gone early breaks the others' last exchange).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


# ---- the command -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m engine.cli.bench_shard", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4", help="rank counts to time (default 1,2,4)")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=64)
    parser.add_argument("-g", "--generation-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--vs", choices=["mlx-lm"], help="also time mlx-lm's sharded_load pipeline")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "qwen2-tiny")
        for n in [int(x) for x in args.ranks.split(",")]:
            row: dict[str, Any] = {
                "ranks": n,
                "ours": ours(folder, n, args.prompt_tokens, args.generation_tokens, args.repeat),
            }
            if args.vs:
                row["mlx_lm"] = theirs(folder, n, args.prompt_tokens, args.generation_tokens, args.repeat)
                row["ratio"] = row["ours"]["generation_tps"] / row["mlx_lm"]["generation_tps"]
            rows.append(row)
            if not args.json:
                print(_line(row), flush=True)
    if args.json:
        print(json.dumps({"shape": SHAPE, "rows": rows}))
    return 0


def _line(row: dict[str, Any]) -> str:
    text = f"{row['ranks']} rank(s): ours {row['ours']['generation_tps']:.1f} gen tok/s, {row['ours']['prompt_tps']:.1f} prompt tok/s"
    if "mlx_lm" in row:
        text += (
            f"; mlx-lm {row['mlx_lm']['generation_tps']:.1f} gen tok/s, {row['mlx_lm']['prompt_tps']:.1f} prompt tok/s"
        )
        text += f"; ratio {row['ratio']:.2f}"
    return text


if __name__ == "__main__":
    sys.exit(main())
