"""``python -m engine bench``: speed on random weights of a real model's shape.

The model is built from the architecture's real config (no download), cast to bf16 and
quantized with ``nn.quantize`` like a published MLX checkpoint, then our decode loop
runs on it after a warm-up. ``--vs mlx-lm`` loads the very same weights into mlx-lm's
model class for that ``model_type`` and times mlx-lm's own ``generate_step`` in the
same process, so the ratio compares loops and model code, nothing else.
``--speculative`` times plain next to speculative decoding instead (engine/cli/bench_speculative.py);
``--concurrent 1,2,4,8`` times streams decoding together (engine/cli/bench_concurrent.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.cli.bench_shapes import FIXED_QUANTIZATION, SHAPES, attention_heads
from engine.cli.experts import add_resident_experts
from engine.cli.numbers import whole
from engine.errors import EngineError


@dataclass
class Timing:
    prompt_tokens: int
    generated_tokens: int
    prompt_tps: float
    generation_tps: float
    ttft_s: float
    peak_memory_bytes: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli.bench_media import MEDIA_SHAPES, add_media_arguments

    p.add_argument("--shape", choices=sorted(set(SHAPES) | set(MEDIA_SHAPES)), default="qwen3-4b")
    p.add_argument("--bits", type=int, default=4, help="2-8 (affine quantized), 16 for bf16")
    p.add_argument("--group-size", type=int, choices=[16, 32, 64, 128], default=64)
    p.add_argument(
        "--mode",
        choices=["affine", "mxfp4", "mxfp8", "nvfp4"],
        default="affine",
        help="quantization mode; mxfp4, mxfp8 and nvfp4 set their own bits and group size",
    )
    p.add_argument("-p", "--prompt-tokens", type=whole("-p", 1, 1 << 20), default=512)
    p.add_argument("-g", "--generation-tokens", type=whole("-g", 2, 1 << 20), default=128)
    p.add_argument(
        "--vs",
        choices=["mlx-lm", "mlx-vlm"],
        help="also time mlx-lm on the same weights (mlx-vlm: with --media, or for the DiffusionGemma shapes)",
    )
    p.add_argument(
        "--denoising-steps",
        type=whole("--denoising-steps", 1, 10_000),
        default=48,
        help="DiffusionGemma shapes: the most steps a block takes",
    )
    p.add_argument(
        "--repeat",
        type=whole("--repeat", 1, 1000),
        default=1,
        help="timed runs per loop, interleaved; each figure is reported at its best and as a median",
    )
    p.add_argument("--seed", type=whole("--seed", 0, 2**32 - 1), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--no-compile", action="store_true", help="decode with the plain forward pass only")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], help="hold the KV cache quantized (both loops)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument(
        "--reopen",
        action="store_true",
        help="time to first token reopening a -p token chat from its saved cache vs prefilling it",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="also print bytes read per decoded token, the measured copy bandwidth, the ceiling and each loop's share",
    )
    add_media_arguments(p)
    add_resident_experts(p, many=True)


def build_model(
    shape: str, bits: int, group_size: int, seed: int = 0, mode: str = "affine"
) -> tuple[Any, dict[str, Any], set[str]]:
    """Random weights of ``shape``; returns (model, config, paths of quantized modules)."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.models import get_family

    config = dict(SHAPES[shape])
    family = get_family(config["model_type"])
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    quantized: set[str] = set()
    if bits not in (2, 3, 4, 5, 6, 8, 16):
        raise EngineError(f"--bits must be 2-6, 8 (quantized) or 16 (bf16), not {bits}")
    pattern, fixed = FIXED_QUANTIZATION.get(shape, (None, {}))
    overrides: dict[str, dict[str, Any]] = {}

    def pick(path: str, module: Any) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized"):
            return False
        if pattern is not None and re.search(pattern, path):
            overrides[path] = dict(fixed)
            quantized.add(path)
            return dict(fixed)
        ok = bits != 16 and module.weight.shape[-1] % group_size == 0
        if ok:
            quantized.add(path)
        return ok

    nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=pick)
    if quantized:
        # mlx-lm's spelling: global settings plus one entry per module quantized otherwise.
        base = {"group_size": group_size, "bits": bits, "mode": mode} if bits != 16 else dict(fixed)
        config["quantization"] = {**base, **overrides}
    # Materialise layer by layer so float32 random init never exists for the whole model.
    for layer in getattr(model, "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model, config, quantized


def quantize_as_ours(twin: Any, config: dict[str, Any], quantized: set[str], nest: str = "") -> None:
    """Quantize a peer's model (or a slice of ours) as ``build_model`` quantized ours: the
    module paths in ``quantized`` (under ``nest`` in the peer's tree), each with the settings
    ``config["quantization"]`` gives it (its own entry, else the global ones)."""
    if not quantized:
        return
    import mlx.nn as nn

    q = config["quantization"]
    nn.quantize(
        twin,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=lambda p, m: p.removeprefix(nest) in quantized and q.get(p.removeprefix(nest), True),
    )


def mlx_lm_twin(model: Any, config: dict[str, Any], quantized: set[str]) -> Any:
    """mlx-lm's model for the same ``model_type``, holding exactly ``model``'s weights."""
    try:
        import importlib

        mlx_lm_models = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    except ImportError:
        raise EngineError("--vs mlx-lm needs mlx-lm: pip install 'mlx-desk[bench]' (or mlx-lm)") from None
    import mlx.core as mx
    from mlx.utils import tree_flatten

    twin = mlx_lm_models.Model(mlx_lm_models.ModelArgs.from_dict(config))
    twin.set_dtype(mx.bfloat16)
    # mlx-lm nests some text models under language_model (Qwen3.5); ours are not nested.
    nest = "language_model." if "language_model" in twin and "language_model" not in model else ""
    quantize_as_ours(twin, config, quantized, nest)
    try:
        # mlx-lm drops built-in MTP layers (mtp.*): its twin runs without them.
        weights = [(nest + k, v) for k, v in tree_flatten(model.parameters()) if not k.startswith("mtp.")]
        # In the dtype mlx-lm would load them in (ours holds a few in float32, e.g. MoE routers).
        theirs = dict(tree_flatten(twin.parameters()))
        weights = [(k, v.astype(theirs[k].dtype) if k in theirs and v.dtype == mx.float32 else v) for k, v in weights]
        twin.load_weights(weights, strict=True)
    except ValueError as e:
        raise EngineError(f"mlx-lm's {config['model_type']} does not take our weights: {e}") from None
    mx.eval(twin.parameters())
    return twin


def _ours(model: Any, prompt: Any, max_tokens: int, compiled: bool | None = None) -> Iterator[int]:
    from engine.decode.loop import generate_step
    from engine.models.kv_cache import make_prompt_cache
    from engine.models.paged_kv import sequence_of

    cache = make_prompt_cache(model)
    for token, _ in generate_step(prompt, model, cache, max_tokens=max_tokens, prefill_chunk=2048, compiled=compiled):
        yield token
    sequence = sequence_of(cache)
    if sequence is not None:  # paged: end the request as the app does (its blocks written), inside the timing
        start = time.perf_counter()
        sequence.drop_views()
        REQUEST_ENDS.append(time.perf_counter() - start)


# Seconds each paged request's end took (its blocks stored), inside the timed decode: the
# reply is complete before it, so ``bench --paged-kv`` prints it apart too.
REQUEST_ENDS: list[float] = []


def _ours_plain(model: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    return _ours(model, prompt, max_tokens, compiled=False)


def _ours_unpaged(model: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    """``_ours`` with the model's block pool set aside: ``bench --paged-kv``'s reference,
    timed in the same run as the paged loop, so machine drift falls on both alike."""
    pool, model.kv_pool = model.kv_pool, None
    try:
        yield from _ours(model, prompt, max_tokens)
    finally:
        model.kv_pool = pool


def _theirs(model: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    from mlx_lm.generate import generate_step

    kv = getattr(model, "bench_kv", None) or {}  # --kv-bits: mlx-lm's QuantizedKVCache from the start
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens, prefill_step_size=2048, **kv):
        yield int(token)


def time_loop(loop: Callable[[Any, Any, int], Iterator[int]], model: Any, prompt: Any, gen: int) -> Timing:
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = start
    n = 0
    for _ in loop(model, prompt, gen):
        if n == 0:
            first = time.perf_counter()
        n += 1
    end = time.perf_counter()
    return Timing(
        prompt_tokens=int(prompt.size),
        generated_tokens=n,
        prompt_tps=prompt.size / max(first - start, 1e-9),
        generation_tps=(n - 1) / max(end - first, 1e-9) if n > 1 else 0.0,
        ttft_s=first - start,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )


def _best(runs: list[Timing]) -> Timing:
    """Each figure at its best over the runs: on a shared machine noise only ever slows
    a run down, and prefill and decode are disturbed in different runs."""
    return Timing(
        prompt_tokens=runs[0].prompt_tokens,
        generated_tokens=max(t.generated_tokens for t in runs),
        prompt_tps=max(t.prompt_tps for t in runs),
        generation_tps=max(t.generation_tps for t in runs),
        ttft_s=min(t.ttft_s for t in runs),
        peak_memory_bytes=max(t.peak_memory_bytes for t in runs),
    )


def _median(runs: list[Timing]) -> dict[str, float]:
    return {
        "prompt_tps": statistics.median(t.prompt_tps for t in runs),
        "generation_tps": statistics.median(t.generation_tps for t in runs),
    }


Loop = Callable[[Any, Any, int], Iterator[int]]


def measure_interleaved(
    loops: Sequence[tuple[Loop, Any]],
    prompt: Any,
    gen: int,
    repeat: int,
    errors: dict[int, str] | None = None,
    peers_from: int = 1,
) -> list[tuple[Timing, list[Timing]] | None]:
    """Time each ``(loop, model)`` ``repeat`` times, interleaved: every repeat runs all of
    them, in reverse order every other time (A B, B A, ...), so clock and thermal drift
    fall on all alike instead of on whichever ran last. Returns (best, every run) per loop.

    With ``errors``, a loop from ``peers_from`` on (a peer's) that raises is dropped instead of
    ending the bench: its one-line reason goes to ``errors[i]`` and its entry is None, so
    the engine's figures survive a peer that cannot run the shape (mlx-lm's quantized KV
    cache on MLX's CUDA build: "[quantized_matmul] No implementation for problem shape")."""
    failed: set[int] = set()

    def timed(i: int, tokens: int) -> Timing | None:
        loop, model = loops[i]
        if errors is None or i < peers_from:
            return time_loop(loop, model, prompt, tokens)
        try:
            return time_loop(loop, model, prompt, tokens)
        except Exception as e:  # noqa: BLE001 - any failure of the peer's own code
            errors[i] = f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")
            failed.add(i)
            return None

    for i in range(len(loops)):
        timed(i, min(gen, 4))  # warm-up: kernels for these shapes
    runs: list[list[Timing]] = [[] for _ in loops]
    order = list(range(len(loops)))
    for r in range(max(1, repeat)):
        for i in order if r % 2 == 0 else order[::-1]:
            if i not in failed and (t := timed(i, gen)) is not None:
                runs[i].append(t)
    return [None if i in failed else (_best(each), each) for i, each in enumerate(runs)]


def measure(loop: Loop, model: Any, prompt: Any, gen: int, repeat: int) -> Timing:
    best = measure_interleaved([(loop, model)], prompt, gen, repeat)[0]
    assert best is not None  # the first loop's failure is raised, never dropped
    return best[0]


def with_runs(best: Timing, runs: list[Timing]) -> dict[str, Any]:
    """The best figures for ``--json``, the medians under ``median``, every run under ``runs``."""
    return {**asdict(best), "median": _median(runs), "runs": [asdict(t) for t in runs]}


def _row(name: str, t: Timing) -> str:
    return (
        f"{name:<8} prompt {t.prompt_tps:10.1f} tok/s   generation {t.generation_tps:8.1f} tok/s   "
        f"ttft {t.ttft_s * 1000:8.1f} ms   peak {t.peak_memory_bytes / 1e9:6.2f} GB"
    )


def run_bench(
    args: argparse.Namespace,
    speculative: Callable[..., dict[str, Any]] | None = None,
    concurrent: Callable[..., dict[str, Any]] | None = None,
) -> int:
    """Time the shape; with ``--speculative``, ``speculative`` (bench_speculative's runner,
    which builds on this module) times plain next to speculative decoding instead, and with
    ``--concurrent``, ``concurrent`` (bench_concurrent's) times streams decoding together."""
    import mlx.core as mx

    if getattr(args, "media", None) or args.shape not in SHAPES:
        from engine.cli.bench_media import run_media_bench

        return run_media_bench(args)
    if args.prompt_tokens < 1 or args.generation_tokens < 2:
        raise EngineError("bench needs -p >= 1 and -g >= 2")
    if getattr(args, "resident_experts", None):
        from engine.cli.bench_experts import run_experts_bench

        return run_experts_bench(args, build_model)
    diffusion = SHAPES[args.shape]["model_type"] == "diffusion_gemma"
    if (args.vs == "mlx-vlm") != (diffusion and args.vs is not None):
        raise EngineError(
            "--vs mlx-vlm goes with --media image|video or the DiffusionGemma shapes, --vs mlx-lm with the others"
        )
    if getattr(args, "profile", False) and not (diffusion or getattr(args, "concurrent", None)):
        raise EngineError(
            "--profile goes with --concurrent N,N,... or a DiffusionGemma shape (--shape diffusion-gemma-...)"
        )
    if args.vs == "mlx-lm":
        import importlib.util

        if importlib.util.find_spec("mlx_lm") is None:
            raise EngineError("--vs mlx-lm needs mlx-lm installed: pip install 'mlx-desk[bench]' (or mlx-lm)")
    if args.mode != "affine":  # each floating-point mode has one (bits, group size)
        from engine.artifacts.mlx_quant import MODES

        args.bits, args.group_size = MODES[args.mode].default
    model, config, quantized = build_model(args.shape, args.bits, args.group_size, args.seed, args.mode)
    prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_tokens,), key=mx.random.key(args.seed)).astype(
        mx.uint32
    )
    mx.eval(prompt)
    quant = f"{args.bits}-bit g{args.group_size}" if args.bits != 16 else "bf16"
    quant = f"{args.mode} {quant}" if quantized and args.mode != "affine" and args.bits != 16 else quant
    if args.shape in FIXED_QUANTIZATION:
        quant += f", {FIXED_QUANTIZATION[args.shape][1]['mode']} experts"
    from engine.models import quantized_matmul_cuda

    if quantized and quantized_matmul_cuda.enabled():  # on by default on CUDA: say so beside the figures
        quant += ", small-row kernel on"
    print(
        f"{args.shape} ({quant}, random weights) on {mx.default_device()}: "
        f"{args.prompt_tokens}-token prompt, {args.generation_tokens} generated",
        flush=True,
    )
    out: dict[str, Any] = {
        "shape": args.shape,
        "bits": args.bits if quantized else 16,
        "group_size": args.group_size,
        "mode": args.mode,
        "device": str(mx.default_device()),
    }
    kv_bits = getattr(args, "kv_bits", None)
    if kv_bits is not None:
        from engine.models.kv_cache import make_prompt_cache
        from engine.models.quantized_kv_cache import KVQuantization, describe, uniform

        settings = uniform(kv_bits, args.kv_group_size, len(make_prompt_cache(model)))
        model.kv_quantization = KVQuantization(settings)
        out["kv_cache"] = describe(settings)
        print(f"KV cache held at {out['kv_cache']}", flush=True)
    if getattr(args, "paged_kv", False) or getattr(args, "paged_kv_block_size", None):
        from engine.cli.paged_args import page_bench_model

        out["paged_kv"] = page_bench_model(args, model)
    if getattr(args, "shared_prompt", False) and not getattr(args, "concurrent", None):
        raise EngineError("--shared-prompt goes with --concurrent N,N,... (streams after one cached prompt)")
    if (getattr(args, "prompts", 1) or 1) > 1 and not getattr(args, "shared_prompt", False):
        raise EngineError("--prompts goes with --concurrent N,N,... --shared-prompt (streams after K cached prompts)")
    if getattr(args, "shared_prefix", None):
        from engine.cli.bench_shared import run_shared

        out["shared_prefix"] = run_shared(args, model, config["vocab_size"], prompt)
        if args.json:
            print(json.dumps(out))
        return 0
    if getattr(args, "reopen", False):
        from engine.cli.bench_reopen import run_reopen

        out["reopen"] = run_reopen(model, prompt, config["vocab_size"], args.seed)
    if diffusion:
        from engine.cli.bench_diffusion import run_diffusion

        out.update(run_diffusion(args, model, config, quantized, prompt))
        if args.json:
            print(json.dumps(out))
        return 0
    if getattr(args, "concurrent", None) and concurrent is not None:
        out.update(concurrent(args, model, config, quantized))
        if args.json:
            print(json.dumps(out))
        return 0
    if args.speculative and speculative is not None:
        out.update(speculative(args, model, config, quantized, prompt))
        if args.json:
            print(json.dumps(out))
        return 0
    loops: list[tuple[Loop, Any]] = [(_ours_plain if args.no_compile else _ours, model)]
    if args.vs == "mlx-lm":
        twin = mlx_lm_twin(model, config, quantized)
        if kv_bits is not None:
            head_dim = attention_heads(config)[2]
            if head_dim % args.kv_group_size:
                raise EngineError(
                    f"mlx-lm's quantized KV cache needs heads ({head_dim}) divisible by "
                    f"--kv-group-size {args.kv_group_size}; pick another shape or group size"
                )
            twin.bench_kv = {"kv_bits": kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": 0}
        loops.append((_theirs, twin))
    paged = "paged_kv" in out and not args.no_compile
    if paged:
        loops.append((_ours_unpaged, model))
    errors: dict[int, str] = {}
    timed = measure_interleaved(loops, prompt, args.generation_tokens, args.repeat, errors)
    assert timed[0] is not None  # the engine's own failure ends the bench
    ours = timed[0][0]
    print(_row("engine", ours), flush=True)
    out["engine"] = with_runs(*timed[0])
    if paged and timed[-1] is not None:
        out["unpaged"] = _paged_against_unpaged(timed[0], timed[-1])
    if args.vs == "mlx-lm":
        out.update(_against_mlx_lm(timed[0], timed[1], errors.get(1, ""), args.repeat))
    if getattr(args, "roofline", False):
        _roofline(model, config, prompt, out, ours, None if args.vs != "mlx-lm" or timed[1] is None else timed[1][0])
    if args.json:
        print(json.dumps(out))
    return 0


def _against_mlx_lm(
    ours: tuple[Timing, list[Timing]], theirs: tuple[Timing, list[Timing]] | None, error: str, repeat: int
) -> dict[str, Any]:
    """mlx-lm's row and the engine/mlx-lm ratios, or why mlx-lm could not run the shape."""
    if theirs is None:
        # The engine's rows stand; --json stays one valid object that says why the peer's are missing.
        print(f"mlx-lm   could not run this shape: {error}", flush=True)
        return {"mlx_lm": None, "mlx_lm_error": error, "ratio": None}
    print(_row("mlx-lm", theirs[0]), flush=True)
    ratio = {
        "prompt": ours[0].prompt_tps / max(theirs[0].prompt_tps, 1e-9),
        "generation": ours[0].generation_tps / max(theirs[0].generation_tps, 1e-9),
    }
    print(f"ratio    prompt {ratio['prompt']:.2f}x   generation {ratio['generation']:.2f}x (engine / mlx-lm)")
    out: dict[str, Any] = {"mlx_lm": with_runs(*theirs), "ratio": ratio}
    if repeat > 1:
        mine, peer = _median(ours[1]), _median(theirs[1])
        out["ratio_of_medians"] = {k: mine[k] / max(peer[k], 1e-9) for k in mine}
        print(
            f"medians  prompt {out['ratio_of_medians']['prompt_tps']:.2f}x   "
            f"generation {out['ratio_of_medians']['generation_tps']:.2f}x (of {repeat} runs each)"
        )
    return out


def _paged_against_unpaged(paged: tuple[Timing, list[Timing]], unpaged: tuple[Timing, list[Timing]]) -> dict[str, Any]:
    """The engine unpaged, timed in the same run; paged over unpaged, best to best and of medians."""
    print(_row("unpaged", unpaged[0]), flush=True)
    best = {
        "prompt": paged[0].prompt_tps / max(unpaged[0].prompt_tps, 1e-9),
        "generation": paged[0].generation_tps / max(unpaged[0].generation_tps, 1e-9),
    }
    mine, ref = _median(paged[1]), _median(unpaged[1])
    medians = {k: mine[k] / max(ref[k], 1e-9) for k in mine}
    end_ms = statistics.median(REQUEST_ENDS) * 1000 if REQUEST_ENDS else 0.0
    print(
        f"paged    prompt {best['prompt']:.2f}x   generation {best['generation']:.2f}x of unpaged "
        f"(medians {medians['prompt_tps']:.2f}x, {medians['generation_tps']:.2f}x); "
        f"each request's end (blocks stored, in the decode time) {end_ms:.1f} ms",
        flush=True,
    )
    return {
        **with_runs(*unpaged),
        "paged_ratio": best,
        "paged_ratio_of_medians": medians,
        "request_end_ms": end_ms,
    }


def _roofline(
    model: Any, config: dict[str, Any], prompt: Any, out: dict[str, Any], ours: Timing, theirs: Timing | None
) -> None:
    """Measured after the timed runs, so its prefill and copies disturb none of them."""
    from engine.cli import roofline

    line = roofline.measure(model, config, prompt).with_rates(
        ours.generation_tps, None if theirs is None else theirs.generation_tps
    )
    print(line.row(), flush=True)
    out["roofline"] = line.as_json()
