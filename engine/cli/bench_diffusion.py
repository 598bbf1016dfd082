"""``python -m engine bench --shape diffusion-gemma-26b-a4b``: block diffusion on random
weights of DiffusionGemma's published shape (engine/cli/bench.py builds the model).

A reply is written a block of ``canvas_length`` tokens at a time, each block taking up to
``--denoising-steps`` decoder passes over the whole canvas, so the figures that matter
are the prompt encoder's speed, the time of one denoising step, and tokens per second
over whole blocks. Random weights are never confident, so every block takes every step:
the worst case (a trained model stops a block early once its prediction holds still;
transformers' default is at most 48 steps). The end-of-sequence id is ignored, so the
reply is ``-g`` rounded up to whole blocks.

``--profile`` then takes one denoising step apart (engine/cli/bench_diffusion_parts.py).

``--vs mlx-vlm`` also times mlx-vlm's DiffusionGemma on the very same weights, in the same
process, with the same canvas and step budget (its default sampler; its steps are
reported beside ours, since its stopping rule is its own).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from engine.errors import EngineError


@dataclass
class DiffusionTiming:
    prompt_tokens: int
    generated_tokens: int
    blocks: int
    denoising_steps: int
    prompt_tps: float
    generation_tps: float  # generated tokens over the time after the prompt, whole blocks
    step_ms: float  # one decoder pass over the canvas, on average
    ttft_s: float  # until the first block is written
    peak_memory_bytes: int


def time_ours(model: Any, prompt: Any, gen: int, steps: int, seed: int) -> DiffusionTiming:
    """Encode all but the prompt's last token (timed as the prompt), then let the block
    loop encode that token and write ``gen`` tokens (rounded up to blocks) after it."""
    import mlx.core as mx

    from engine.decode.diffusion import Block, DiffusionSettings, RandomNoise, diffuse
    from engine.models.kv_cache import make_prompt_cache
    from engine.models.stacked import stack_projections

    settings = DiffusionSettings(steps=steps, confidence_threshold=0.0)  # never stops early: every step counts
    ids = [int(t) for t in prompt.tolist()]
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    stack_projections(model)  # as a reply does before its prompt (``diffuse``)
    start = time.perf_counter()
    if len(ids) > 1:
        model.encode(mx.array([ids[:-1]]), cache)  # evaluates the keys and values
    prompt_done = time.perf_counter()
    first = None
    written, taken, blocks = 0, 0, 0
    for block in diffuse(model, ids[-1:], max_tokens=gen, settings=settings, noise=RandomNoise(seed), cache=cache):
        assert isinstance(block, Block)
        written += len(block.tokens)
        taken += block.steps
        blocks += 1
        first = first or time.perf_counter()
    end = time.perf_counter()
    generation_s = max(end - prompt_done, 1e-9)
    return DiffusionTiming(
        prompt_tokens=len(ids),
        generated_tokens=written,
        blocks=blocks,
        denoising_steps=taken,
        prompt_tps=(len(ids) - 1) / max(prompt_done - start, 1e-9),
        generation_tps=written / generation_s,
        step_ms=1000 * generation_s / max(taken, 1),
        ttft_s=(first or end) - start,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )


def _row(name: str, t: DiffusionTiming) -> str:
    return (
        f"{name:<8} prompt {t.prompt_tps:10.1f} tok/s   generation {t.generation_tps:8.1f} tok/s   "
        f"{t.denoising_steps} steps over {t.blocks} blocks ({t.step_ms:.1f} ms a step)   "
        f"ttft {t.ttft_s * 1000:8.1f} ms   peak {t.peak_memory_bytes / 1e9:6.2f} GB"
    )


def _profile(model: Any, prompt: Any, repeat: int, seed: int) -> dict[str, float]:
    """One denoising step's parts after the prompt (``bench_diffusion_parts``)."""
    from engine.cli.bench_diffusion_parts import print_parts, step_parts
    from engine.models.kv_cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model.encode(prompt[None], cache)
    parts = step_parts(model, cache, max(3, repeat), seed)
    print_parts(parts)
    return parts


def run_diffusion(args: Any, model: Any, config: dict[str, Any], quantized: set[str], prompt: Any) -> dict[str, Any]:
    """Warm up, then ``--repeat`` timed runs (interleaved with mlx-vlm's when asked); the
    figures are each run's best, every run kept under ``runs``."""
    steps = args.denoising_steps
    if steps < 1:
        raise EngineError("--denoising-steps must be at least 1")
    print(
        f"block diffusion: canvas {model.canvas_length} tokens, up to {steps} denoising steps a block "
        "(random weights take them all)",
        flush=True,
    )
    loops: list[tuple[str, Any]] = [("engine", lambda g: time_ours(model, prompt, g, steps, args.seed))]
    if args.vs == "mlx-vlm":
        from engine.cli.bench_diffusion_mlx_vlm import mlx_vlm_twin, time_mlx_vlm

        twin = mlx_vlm_twin(model, config, quantized, steps)
        loops.append(("mlx-vlm", lambda g: DiffusionTiming(**time_mlx_vlm(twin, prompt, g, steps, args.seed))))
    canvas = model.canvas_length
    gen = -(-args.generation_tokens // canvas) * canvas  # whole blocks: both loops do the same work
    for _, run in loops:
        run(1)  # warm-up: one block
    runs: list[list[DiffusionTiming]] = [[] for _ in loops]
    for r in range(max(1, args.repeat)):
        order = range(len(loops)) if r % 2 == 0 else reversed(range(len(loops)))
        for i in order:
            runs[i].append(loops[i][1](gen))
    out: dict[str, Any] = {"canvas_length": canvas, "max_denoising_steps": steps}
    for (name, _), each in zip(loops, runs):
        best = min(each, key=lambda t: t.step_ms)
        best = DiffusionTiming(
            **{
                **asdict(best),
                "prompt_tps": max(t.prompt_tps for t in each),
                "generation_tps": max(t.generation_tps for t in each),
            }
        )
        print(_row(name, best), flush=True)
        out[name.replace("-", "_")] = {**asdict(best), "runs": [asdict(t) for t in each]}
    if getattr(args, "profile", False):
        out["engine"]["parts"] = _profile(model, prompt, args.repeat, args.seed)
    if len(loops) == 2:
        ours, theirs = out["engine"], out["mlx_vlm"]
        out["ratio"] = {
            "prompt": ours["prompt_tps"] / max(theirs["prompt_tps"], 1e-9),
            "generation": ours["generation_tps"] / max(theirs["generation_tps"], 1e-9),
            "step": theirs["step_ms"] / max(ours["step_ms"], 1e-9),
        }
        r = out["ratio"]
        print(
            f"ratio    prompt {r['prompt']:.2f}x   generation {r['generation']:.2f}x   "
            f"per step {r['step']:.2f}x (engine / mlx-vlm)"
        )
    return out
