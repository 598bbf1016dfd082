"""``bench --resident-experts 1,0.5,0.25,0.125``: decode speed with experts read from disk.

The random-weight model of ``--shape`` is written once as an MLX checkpoint (config.json +
model.safetensors, mlx-lm's layout) in a scratch folder, and the disk under it is measured
dd-style: sequential and random 1 MB reads with the range dropped from the page cache
first. Then, for each residency, the model is loaded from that folder as a user would load
it (every non-expert weight resident, a slab of ``F`` of each layer's experts, the rest
read by byte range when routed), the file's pages are dropped from the page cache, and
the engine's generate loop runs: tok/s, the slab's hit rate and the bytes read per
generated token are printed, with the speed the disk would allow at those bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.errors import EngineError


def write_checkpoint(model: Any, config: dict[str, Any], folder: Path) -> Path:
    """The model's parameters as one safetensors file, names as mlx-lm saves them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    # A shape's zero dense width (every layer MoE) is not a config a checkpoint may carry.
    config = {k: v for k, v in config.items() if not (k == "intermediate_size" and not v)}
    (folder / "config.json").write_text(json.dumps(config))
    file = folder / "model.safetensors"
    mx.save_safetensors(str(file), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    with file.open("rb+") as f:  # on disk, so dropping its pages from the cache really drops them
        os.fsync(f.fileno())
    return file


def drop_cached(file: Path) -> None:
    """Ask the system to forget the file's pages (reads then come from the disk)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    fd = os.open(file, os.O_RDONLY)
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(folder: Path, fraction: float, prompt: Any, gen: int, compiled: bool | None = None) -> dict[str, Any]:
    """Load ``folder`` keeping ``fraction`` of the experts, decode ``gen`` tokens, and
    report speed and streaming figures of the decode alone (the prefill's reads apart).
    ``compiled`` as generate_step takes it (None: the compiled step where it applies, which
    a streamed model declines)."""
    import mlx.core as mx

    from engine.decode.loop import generate_step
    from engine.models.kv_cache import make_prompt_cache
    from engine.runtime.expert_plan import expert_store, stop_streaming
    from engine.runtime.loading import load_model

    loaded = load_model(folder, resident_experts=fraction, memory_budget=1 << 50)
    model = loaded.model
    store = expert_store(model)
    try:
        _decode(model, prompt, min(gen, 4), compiled)  # warm-up: kernels, and the slab takes its first experts
        drop_cached(folder / "model.safetensors")
        mx.reset_peak_memory()
        marks: list[dict[str, float]] = []

        def mark() -> None:
            s = store.stats if store is not None else None
            counts = {k: getattr(s, k) if s else 0 for k in _COUNTS}
            marks.append({"t": time.perf_counter(), **counts})

        mark()
        n = 0
        steps = generate_step(
            prompt, model, make_prompt_cache(model), max_tokens=gen, prefill_chunk=2048, compiled=compiled
        )
        for _token, _ in steps:
            n += 1
            if n == 1:
                mark()
        mark()
    finally:
        stop_streaming(model)
    start, first, end = marks
    steps = max(1, n - 1)
    decode = {k: end[k] - first[k] for k in end}
    misses = decode["lookups"] - decode["hits"]
    residency = loaded.plan.experts
    return {
        "resident_experts": fraction,
        "slots": residency.slots if residency else 0,
        "experts": residency.experts if residency else 0,
        "prompt_tps": prompt.size / max(first["t"] - start["t"], 1e-9),
        "generation_tps": steps / max(decode["t"], 1e-9),
        "hit_rate": decode["hits"] / decode["lookups"] if decode["lookups"] else 1.0,
        "read_bytes_per_token": decode["read_bytes"] / steps,
        "wasted_bytes_per_token": decode["wasted_bytes"] / steps,  # read ahead for guesses never routed
        "misses_read_ahead": decode["read_ahead"] / misses if misses else None,
        # the share of experts a router picked one layer early that were then routed
        "router_guesses_right": _share(decode["router_right"], decode["router_guesses"]),
        "frequency_guesses_right": _share(decode["frequency_right"], decode["frequency_guesses"]),
        "resident_bytes": loaded.plan.weights_bytes,
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }


def best_runs(
    folder: Path,
    fractions: list[float],
    prompt: Any,
    gen: int,
    repeat: int,
    compiled: bool | None = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Each residency's fastest of ``repeat`` runs, the residencies taken in turn each time
    (in reverse every other time) so drift on a shared machine falls on all alike.
    ``progress(row, run)`` sees every run as it ends: a streamed row on a slow disk can take
    minutes, and a run cut short must still have said what it measured."""
    best: dict[int, dict[str, Any]] = {}
    order = list(range(len(fractions)))
    for r in range(repeat):
        for i in order if r % 2 == 0 else order[::-1]:
            row = run_once(folder, fractions[i], prompt, gen, compiled)
            if progress is not None:
                progress(row, r + 1)
            if i not in best or row["generation_tps"] > best[i]["generation_tps"]:
                best[i] = row
    return [best[i] for i in order]


def _decode(model: Any, prompt: Any, n: int, compiled: bool | None = None) -> None:
    from engine.decode.loop import generate_step
    from engine.models.kv_cache import make_prompt_cache

    for _ in generate_step(
        prompt, model, make_prompt_cache(model), max_tokens=n, prefill_chunk=2048, compiled=compiled
    ):
        pass


def run_experts_bench(args: argparse.Namespace, build_model: Any) -> int:
    import mlx.core as mx

    from engine.runtime.expert_plan import measure_disk

    if args.mode != "affine":
        from engine.artifacts.mlx_quant import MODES

        args.bits, args.group_size = MODES[args.mode].default
    kept = Path(args.checkpoint_dir) if getattr(args, "checkpoint_dir", None) else None
    scratch = kept or Path(tempfile.mkdtemp(prefix="bench-experts-"))
    try:
        file, config = _checkpoint(args, build_model, scratch)
        prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_tokens,), key=mx.random.key(args.seed))
        prompt = prompt.astype(mx.uint32)
        seq, rnd = measure_disk(str(file))
        size = file.stat().st_size
        print(
            f"{args.shape} ({args.bits}-bit {args.mode}, random weights, {size / 1e9:.2f} GB on disk) on "
            f"{mx.default_device()}: {args.prompt_tokens}-token prompt, {args.generation_tokens} generated",
            flush=True,
        )
        print(f"disk     sequential {seq / 1e9:6.2f} GB/s   random 1 MB reads {rnd / 1e9:6.2f} GB/s", flush=True)
        compiled = False if getattr(args, "no_compile", False) else None
        repeat = max(1, args.repeat)
        full: list[float] = []

        def judge(row: dict[str, Any]) -> dict[str, Any]:
            per_token = row["read_bytes_per_token"]
            row["disk_bound_tps"] = rnd / per_token if per_token else None
            row["share_of_full"] = row["generation_tps"] / max(full) if full else None
            return row

        def progress(row: dict[str, Any], run: int) -> None:
            if row["resident_experts"] >= 1:
                full.append(row["generation_tps"])
            prefix = f"run {run}/{repeat}  " if repeat > 1 else ""
            print(prefix + _line(judge(row)), flush=True)

        rows = best_runs(scratch, args.resident_experts, prompt, args.generation_tokens, repeat, compiled, progress)
        if repeat > 1:
            print(f"best of {repeat}:", flush=True)
            for row in rows:
                print(_line(judge(row)), flush=True)
        for row in rows:
            judge(row)
        out = {"shape": args.shape, "bits": args.bits, "mode": args.mode, "device": str(mx.default_device())}
        out.update(disk={"sequential_bps": seq, "random_bps": rnd}, experts=rows)
        if args.json:
            print(json.dumps(out))
    finally:
        if kept is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _checkpoint(args: argparse.Namespace, build_model: Any, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The shape's random checkpoint in ``folder`` and its config: the one there when an
    earlier run wrote it for the same shape, bits, mode and seed, else written now."""
    import mlx.core as mx

    key = {k: getattr(args, k) for k in ("shape", "bits", "group_size", "mode", "seed")}
    made, file = folder / "bench-key.json", folder / "model.safetensors"
    if made.exists() and file.exists() and json.loads(made.read_text()) == key:
        print(f"reusing the checkpoint in {folder}", flush=True)
        return file, json.loads((folder / "config.json").read_text())
    model, config, _ = build_model(args.shape, args.bits, args.group_size, args.seed, args.mode)
    if not any(k in config for k in ("num_experts", "n_routed_experts", "num_local_experts")):
        raise EngineError(f"--resident-experts needs a mixture-of-experts shape; {args.shape} has no experts")
    made.unlink(missing_ok=True)
    write_checkpoint(model, config, folder)
    made.write_text(json.dumps(key))  # last: a write cut short is never reused
    del model
    mx.clear_cache()
    return file, config


_COUNTS = (
    *("read_bytes", "lookups", "hits", "wasted_bytes", "read_ahead"),
    *("router_guesses", "router_right", "frequency_guesses", "frequency_right"),
)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _line(row: dict[str, Any]) -> str:
    share = f"{row['share_of_full']:5.0%} of full" if row["share_of_full"] is not None else ""
    disk = f"   disk allows {row['disk_bound_tps']:8.1f} tok/s" if row["disk_bound_tps"] else ""
    ahead = f", {row['misses_read_ahead']:.0%} of misses read ahead" if row.get("misses_read_ahead") is not None else ""
    for way in ("router", "frequency"):
        if row.get(f"{way}_guesses_right") is not None:
            ahead += f", {way} guesses {row[f'{way}_guesses_right']:.0%} right"
    return (
        f"resident {row['resident_experts']:5.3f} ({row['slots']}/{row['experts']} slots)   "
        f"generation {row['generation_tps']:8.1f} tok/s {share}   hit rate {row['hit_rate']:6.1%}   "
        f"read {row['read_bytes_per_token'] / 1e6:8.2f} MB/token{ahead} "
        f"(+{row['wasted_bytes_per_token'] / 1e6:.2f} read ahead unused){disk}"
    )
