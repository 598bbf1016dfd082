"""``python -m engine bench --shape diffusion-gemma-... --profile``: where one denoising step's
time goes, after the prompt is encoded.

The step is run piece by piece on the same canvas, each piece evaluated before the next
starts, and each piece's time summed over the layers:

- canvas input: the canvas's embeddings, the soft embedding of the previous step's logits
  (a product over the whole vocabulary) and the self-conditioning that mixes them;
- attention: every layer's norm, q/k/v, attention over the cache and the canvas, output;
- feed-forward: the rest of every layer (norms, dense MLP, router and experts), and of
  that the routed experts alone (router and expert product, timed again on their own);
- head: the final norm and the tied embedding's logits with their soft cap;
- sampler: the step's sampling, entropies and acceptance, timed as a whole step of the
  block loop less one unsplit pass.

Each figure is the best of ``repeat`` tries. Evaluating between pieces costs a wait each
(several a layer), so the pieces add up to more than the unsplit pass reported beside them
(84 against 59 ms on an H200 for the 26B-A4B shape): read the parts against each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.cli.bench_qmm import _time


def _best(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` evaluated calls of ``fn``, in milliseconds (one untimed first)."""
    return 1000 * _time(fn, repeat)


def _layer_inputs(model: Any, cache: list, h: Any, offset: int) -> list[tuple[Any, Any]]:
    """Each layer's input and attention output for the canvas input ``h``, evaluated."""
    import mlx.core as mx

    inputs = []
    for layer, c in zip(model.layers, cache):
        attn = model.canvas_attention(layer, c, h, offset)
        mx.eval(attn)
        inputs.append((h, attn))
        h = layer.after_attention(h, attn, None)
        mx.eval(h)
    return inputs


def _routed(layer: Any, h: Any, attn: Any) -> Any:
    """A MoE layer's router and expert product on the input its feed-forward sees."""
    x = h + layer.post_attention_layernorm(attn)
    chosen, weights = layer.router(x)
    return layer.experts(layer.pre_feedforward_layernorm_2(x), chosen, weights)


def step_parts(model: Any, cache: list, repeat: int = 3, seed: int = 0) -> dict[str, float]:
    """Milliseconds per denoising step, by part, after what ``cache`` holds (unchanged: a
    denoising step only reads the cache)."""
    import mlx.core as mx

    from engine.decode.diffusion import DiffusionSettings, RandomNoise, denoise_steps

    length, vocab = model.canvas_length, model.args.vocab_size
    canvas = mx.random.randint(0, vocab, (1, length), key=mx.random.key(seed))
    previous = model.denoise(canvas, cache)
    mx.eval(previous)
    previous = previous[0]
    offset = cache[0].offset
    h = model.canvas_input(canvas, previous)
    mx.eval(h)
    layers = _layer_inputs(model, cache, h, offset)
    final = model.layers[-1].after_attention(*layers[-1], None)
    moe = [(layer, x, a) for layer, (x, a) in zip(model.layers, layers) if getattr(layer, "moe", False)]
    parts = {
        "canvas input": _best(lambda: model.canvas_input(canvas, previous), repeat),
        "attention": sum(
            _best(lambda layer=layer, c=c, x=x: model.canvas_attention(layer, c, x, offset), repeat)
            for layer, c, (x, _) in zip(model.layers, cache, layers)
        ),
        "feed-forward": sum(
            _best(lambda layer=layer, x=x, a=a: layer.after_attention(x, a, None), repeat)
            for layer, (x, a) in zip(model.layers, layers)
        ),
        "of which routed experts": sum(
            _best(lambda layer=layer, x=x, a=a: _routed(layer, x, a), repeat) for layer, x, a in moe
        ),
        "head": _best(lambda: model.logits(model.model.norm(final)), repeat),
    }
    one_pass = _best(lambda: model.denoise(canvas, cache, previous), repeat)
    steps = max(2, repeat)
    settings = DiffusionSettings(steps=steps, confidence_threshold=0.0)
    for _ in denoise_steps(model, cache, settings, RandomNoise(seed)):  # untimed: first use
        pass
    start = time.perf_counter()
    taken = sum(1 for _ in denoise_steps(model, cache, settings, RandomNoise(seed)))
    step = 1000 * (time.perf_counter() - start) / taken
    parts["sampler"] = max(0.0, step - one_pass)
    parts["one pass, unsplit"] = one_pass
    parts["one step of the block loop"] = step
    return parts


def print_parts(parts: dict[str, float]) -> None:
    print("one denoising step by part (ms, best of tries; pieces evaluated apart):", flush=True)
    for name, ms in parts.items():
        print(f"  {name:<28} {ms:9.2f}", flush=True)
