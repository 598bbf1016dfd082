"""``python -m engine.cli.shard_gpu_check``: the split model on GPUs over NCCL, checked and timed.

Writes random-weight checkpoints of published shapes (engine/cli/bench_shapes.py; one
safetensors file per layer under an index, so each rank opens only its share; a
word-level tokenizer), then runs ``python -m engine generate`` on the very same files:

- ``check`` (one GPU): each shape as one process, then as one NCCL rank
  (``--hosts 127.0.0.1 --backend nccl``, pipeline and tensor): greedy ids must be equal;
  prints tok/s of each. Exit status 1 when any differ.
- ``measure`` (two GPUs): each shape on one GPU, then as two NCCL ranks (pipeline and
  tensor), for each prompt length; and, with ``--vs mlx-lm``, mlx-lm on the same files
  (``load`` on one GPU; ``sharded_load`` with a pipeline or tensor group over NCCL on two).
  Prints prompt and decode tok/s, time to first token, rank 0's peak memory (MLX's
  count), each GPU's peak use (``nvidia-smi``, sampled through the run), and whether the
  greedy ids equal one GPU's (else the first position where they part).

Every NCCL rank runs with NVLink multicast off (the launcher sets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``; mlx-lm's ranks here get
the same). ``--backend ring`` runs the same on a CPU build (a dry run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.runtime.shard_group import NCCL_ENV

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
CHECK_SHAPES = "tiny,qwen2.5-0.5b"
# The MoE one: Qwen3.5-35B-A3B, which mlx-lm can pipeline (its llama and qwen3 cannot; our
# tensor split refuses qwen3_5_moe in one line, which the table then shows).
MEASURE_SHAPES = "llama3-8b,qwen3-4b,qwen3.5-35b-a3b"


def write_checkpoint(shape: str, bits: int, folder: Path) -> Path:
    """Random weights of ``shape`` at ``bits`` (16: bf16), one file per layer, indexed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.cli.bench import build_model

    if (folder / "config.json").is_file():
        return folder  # written by an earlier run: the same seed, the same weights
    folder.mkdir(parents=True, exist_ok=True)
    model, config, _ = build_model(shape, bits, 64)
    parts: dict[str, dict[str, Any]] = {}
    for name, value in tree_flatten(model.parameters()):
        m = LAYER.search(name)
        part = f"model-layer{int(m.group(1)):03d}.safetensors" if m else "model-rest.safetensors"
        parts.setdefault(part, {})[name] = value
    weight_map = {}
    for part, tensors in parts.items():
        mx.save_safetensors(str(folder / part), tensors, metadata={"format": "mlx"})
        weight_map.update({n: part for n in tensors})
    del model
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {k: v for k, v in config.items() if not (k == "intermediate_size" and not v)}
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


def prompt(n: int, folder: Path) -> list[int]:
    """``n`` ids spread over the vocabulary (past the end ids), the same every run."""
    config = json.loads((folder / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    return [3 + (i * 7) % min(2000, vocab - 3) for i in range(n)]


class GpuPeaks:
    """Each GPU's most memory in use while a run lasts, sampled from ``nvidia-smi`` (what
    the device holds: the process's arrays, MLX's cache and the CUDA context); nothing
    where there is no ``nvidia-smi``."""

    def __init__(self) -> None:
        import shutil
        import threading

        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True) if shutil.which("nvidia-smi") else None

    def _sample(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for row in out.strip().splitlines():
                index, used = (int(x) for x in row.split(","))
                self.peaks[index] = max(self.peaks.get(index, 0), used << 20)
            self._stop.wait(0.2)

    def __enter__(self) -> GpuPeaks:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


# ---- ours ------------------------------------------------------------------------------------


def ours(folder: Path, ids: list[int], gen: int, hosts: str | None, shard: str, backend: str) -> dict[str, Any]:
    """``engine generate`` once (greedy, ids in, --json out); one process when ``hosts`` is None."""
    command = [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--prompt-ids"]
    command += [",".join(map(str, ids)), "--max-tokens", str(gen), "--ignore-eos", "--temp", "0", "--json"]
    if hosts is not None:
        command += ["--hosts", hosts, "--shard", shard, "--backend", backend]
    with GpuPeaks() as gpus:
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["gpu_peak_bytes"] = gpus.peaks
    out["ttft_s"] = out["prompt_tokens"] / out["prompt_tps"] if out.get("prompt_tps") else 0.0
    return out


# ---- mlx-lm ----------------------------------------------------------------------------------


def theirs(folder: Path, ids: list[int], gen: int, ranks: int, shard: str, backend: str) -> dict[str, Any]:
    """mlx-lm on the same files: ``load`` (one rank) or ``sharded_load`` over ``ranks`` local
    ranks started as mlx.launch starts them for NCCL (or ring on a CPU build)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(json.dumps(ids))
    env = dict(os.environ, **NCCL_ENV, MLX_WORLD_SIZE=str(ranks), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(port))
    ring = None
    if backend == "ring" and ranks > 1:
        ports = []
        for _ in range(ranks):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as h:
            h.write(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        env["MLX_HOSTFILE"] = ring = h.name
    args = [sys.executable, "-m", "engine.cli.shard_gpu_check", "--mlx-lm-rank", str(folder), f.name, str(gen)]
    args += [shard, backend]
    procs = [
        subprocess.Popen(
            args,
            env=dict(env, MLX_RANK=str(r), CUDA_VISIBLE_DEVICES=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(ranks)
    ]
    try:
        with GpuPeaks() as gpus:
            both = [p.communicate(timeout=1800) for p in procs]
        outs = [out.decode() for out, _ in both]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(f.name)
        if ring:
            os.unlink(ring)
    lines = outs[0].strip().splitlines()
    if lines:
        return {**json.loads(lines[-1]), "gpu_peak_bytes": gpus.peaks}
    said = [line for _, err in both for line in err.decode(errors="replace").strip().splitlines()[-1:]]
    return {"error": "mlx-lm: " + (said[0] if said else "rank 0 printed nothing")}


def mlx_lm_rank(folder: str, ids_file: str, gen: int, shard: str, backend: str) -> None:
    """One mlx-lm rank: load its share, time one greedy reply (after a warm-up)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load, sharded_load

    ids = json.loads(Path(ids_file).read_text())
    size = int(os.environ.get("MLX_WORLD_SIZE", "1"))
    group = mx.distributed.init(strict=size > 1, backend=backend) if size > 1 else None
    if group is None:
        model = load(folder)[0]
    elif shard == "pipeline":
        model = sharded_load(folder, pipeline_group=group)[0]
    else:
        model = sharded_load(folder, tensor_group=group)[0]
    runs = []
    for _ in range(2):  # a warm-up, then the timed one
        mx.reset_peak_memory()
        start = time.perf_counter()
        first, tokens = None, []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=gen):
            tokens.append(int(tok))
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        runs.append(
            {
                "token_ids": tokens,
                "prompt_tps": len(ids) / (first - start),
                "generation_tps": (gen - 1) / (end - first) if gen > 1 else 0.0,
                "ttft_s": first - start,
                "peak_memory_bytes": mx.get_peak_memory(),
            }
        )
    if group is None or group.rank() == 0:
        print(json.dumps(runs[-1]), flush=True)
    if group is not None:  # no rank leaves before all are done
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


# ---- reporting -------------------------------------------------------------------------------


def parted(ids: list[int], ref: list[int]) -> str:
    if ids == ref:
        return "ids equal"
    at = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    return f"ids part at token {at}"


def line(label: str, r: dict[str, Any], ref: list[int] | None) -> str:
    if "error" in r:
        return f"  {label:34s} error: {r['error']}"
    same = "" if ref is None else "  " + parted(r["token_ids"], ref)
    gpus = r.get("gpu_peak_bytes") or {}
    per_gpu = "  GPUs " + "/".join(f"{gpus[i] / 1e9:.1f}" for i in sorted(gpus)) + " GB" if gpus else ""
    return (
        f"  {label:34s} prompt {r['prompt_tps']:9.1f} tok/s  decode {r['generation_tps']:8.1f} tok/s  "
        f"ttft {r['ttft_s'] * 1000:8.1f} ms  peak {r.get('peak_memory_bytes', 0) / 1e9:6.2f} GB{per_gpu}{same}"
    )


# ---- the command -----------------------------------------------------------------------------


def check(args: argparse.Namespace, root: Path) -> int:
    """One GPU: one process against one NCCL rank, greedy ids equal."""
    failed = 0
    for shape in args.shapes.split(","):
        folder = write_checkpoint(shape, args.bits, root / f"{shape}-{args.bits}bit")
        ids = prompt(args.prompt_tokens, folder)
        print(f"{shape} ({args.bits}-bit), prompt {len(ids)}, {args.max_tokens} tokens:", flush=True)
        single = ours(folder, ids, args.max_tokens, None, "pipeline", args.backend)
        print(line("one process", single, None), flush=True)
        for shard in ("pipeline", "tensor"):
            r = ours(folder, ids, args.max_tokens, "127.0.0.1", shard, args.backend)
            print(line(f"one {args.backend} rank, {shard}", r, single.get("token_ids")), flush=True)
            failed += "error" in r or "error" in single or r["token_ids"] != single["token_ids"]
    print("PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


def measure(args: argparse.Namespace, root: Path) -> int:
    """Two GPUs: one GPU, pipeline and tensor over two; mlx-lm alike with --vs mlx-lm."""
    hosts = ",".join(["127.0.0.1"] * args.ranks)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        folder = write_checkpoint(shape, args.bits, root / f"{shape}-{args.bits}bit")
        for n in [int(x) for x in args.prompts.split(",")]:
            ids = prompt(n, folder)
            print(f"{shape} ({args.bits}-bit), prompt {n}, {args.max_tokens} tokens:", flush=True)
            one = ours(folder, ids, args.max_tokens, None, "pipeline", args.backend)
            print(line("ours, one GPU", one, None), flush=True)
            ref = one.get("token_ids")
            runs = {"ours/1": one}
            for shard in ("pipeline", "tensor"):
                r = runs[f"ours/{shard}"] = ours(folder, ids, args.max_tokens, hosts, shard, args.backend)
                print(line(f"ours, {args.ranks} GPUs {shard}", r, ref), flush=True)
            if args.vs:
                r = runs["mlx-lm/1"] = theirs(folder, ids, args.max_tokens, 1, "pipeline", args.backend)
                print(line("mlx-lm, one GPU", r, ref), flush=True)
                for shard in ("pipeline", "tensor"):
                    r = runs[f"mlx-lm/{shard}"] = theirs(folder, ids, args.max_tokens, args.ranks, shard, args.backend)
                    print(line(f"mlx-lm sharded_load, {args.ranks} GPUs {shard}", r, ref), flush=True)
            rows.append({"shape": shape, "bits": args.bits, "prompt": n, "runs": runs})
    if args.json:
        for row in rows:  # the ids themselves are long: keep whether they agree
            for r in row["runs"].values():
                r.pop("token_ids", None)
                r.pop("text", None)
        print(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--mlx-lm-rank":
        mlx_lm_rank(argv[1], argv[2], int(argv[3]), argv[4], argv[5])
        return 0
    parser = argparse.ArgumentParser(prog="python -m engine.cli.shard_gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["check", "measure"])
    parser.add_argument("--shapes", help=f"default: {CHECK_SHAPES} (check), {MEASURE_SHAPES} (measure)")
    parser.add_argument("--bits", type=int, default=4, help="4 or 8 (quantized), 16 for bf16")
    parser.add_argument("--backend", choices=["nccl", "ring"], default="nccl", help="ring: a dry run on a CPU build")
    parser.add_argument("--ranks", type=int, default=2, help="measure: GPUs to split across")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=64, help="check: prompt length")
    parser.add_argument("--prompts", default="512,8192", help="measure: prompt lengths")
    parser.add_argument("-g", "--max-tokens", type=int, default=32)
    parser.add_argument("--vs", choices=["mlx-lm"], help="measure: also time mlx-lm on the same files")
    parser.add_argument("--dir", help="where the checkpoints go (kept for the next run); default: a temporary folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or (CHECK_SHAPES if args.what == "check" else MEASURE_SHAPES)
    run = check if args.what == "check" else measure
    if args.dir:
        return run(args, Path(args.dir))
    with tempfile.TemporaryDirectory() as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
