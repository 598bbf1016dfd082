"""``python -m engine.cli.bench_layers --shape qwen3.5-35b-a3b``: where a hybrid model's
time goes, one layer kind at a time, next to mlx-lm's same layer on the same weights.

``bench`` times whole models; when the engine trails mlx-lm on a shape, this says which
part does: the first recurrent layer's mixer (gated DeltaNet), the first attention
layer's mixer, a feed-forward block (dense or experts), whole layers, and the engine's
compiled decode step for a recurrent layer. Each is timed for one decode token (after a
prompt, so the states are real) and for a whole prompt, in milliseconds per call, with
the call evaluated and synchronised each time.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _time(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` (evaluated and synchronised), after two warm-ups."""
    import mlx.core as mx

    runs = []
    for i in range(repeat + 2):
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= 2:
            runs.append((time.perf_counter() - start) * 1e3)
    return sorted(runs)[len(runs) // 2]


def _first(layers: list, linear: bool) -> int | None:
    return next((i for i, layer in enumerate(layers) if layer.is_linear == linear), None)


def profile(model: Any, twin: Any, prompt: Any, repeat: int) -> list[tuple[str, float, float]]:
    """(what, engine ms, mlx-lm ms) rows."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as their_cache

    from engine.decode.compiled_hybrid import compiled_decoder

    ours, theirs = model.make_cache(), their_cache(twin)
    model(prompt[None], cache=ours)
    twin(prompt[None], cache=theirs)
    mx.eval([c.state for c in ours], [c.state for c in theirs])
    layers, their_layers = model.layers, twin.layers
    width = model.args.hidden_size
    one = mx.random.normal((1, 1, width)).astype(mx.bfloat16)
    many = mx.random.normal((1, int(prompt.size), width)).astype(mx.bfloat16)
    rows: list[tuple[str, float, float]] = []

    def both(what: str, mine, yours) -> None:
        rows.append((what, _time(mine, repeat), _time(yours, repeat)))

    for linear, name in ((True, "gated DeltaNet"), (False, "attention")):
        i = _first(layers, linear)
        if i is None:
            continue
        a, b = layers[i], their_layers[i]
        mixer_a = a.linear_attn if linear else a.self_attn
        mixer_b = b.linear_attn if linear else b.self_attn
        both(f"{name} mixer, decode", lambda: mixer_a(one, None, ours[i]), lambda: mixer_b(one, None, theirs[i]))
        mask = None if linear else "causal"
        both(f"{name} mixer, prompt", lambda: mixer_a(many, mask, None), lambda: mixer_b(many, mask, None))
        both(f"{name} layer, decode", lambda: a(one, None, ours[i]), lambda: b(one, None, theirs[i]))
    a, b = layers[0].mlp, their_layers[0].mlp
    kind = "experts" if "switch_mlp" in a else "dense"
    both(f"feed-forward ({kind}), decode", lambda: a(one), lambda: b(one))
    both(f"feed-forward ({kind}), prompt", lambda: a(many), lambda: b(many))
    decoder = compiled_decoder(model)
    i = _first(layers, True)
    if decoder is not None and decoder.prepare() and i is not None:
        fns = decoder._fns.get(1) or decoder._build(1)
        decoder._fns[1] = fns
        c = ours[i]
        rows.append(
            (
                "gated DeltaNet layer, compiled decode",
                _time(lambda: fns[i](one, c[0], c[1])[0], repeat),
                float("nan"),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    from engine.cli.bench import SHAPES, build_model, mlx_lm_twin

    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_layers", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny-qwen3.5", choices=[s for s in SHAPES if "qwen3.5" in s])
    p.add_argument("--bits", type=int, default=4, help="4 (default) or 8 (quantized), 16 for bf16")
    p.add_argument("--layers", type=int, default=4, help="layers built (default 4: one of each kind)")
    p.add_argument("-p", "--prompt-tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    shape = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    name = f"{args.shape} ({args.layers} layers)"
    SHAPES[name] = shape
    model, config, quantized = build_model(name, args.bits, 64)
    twin = mlx_lm_twin(model, config, quantized)
    prompt = mx.random.randint(0, int(shape["vocab_size"]), (args.prompt_tokens,), key=mx.random.key(5))
    print(
        f"{args.shape}, {args.bits}-bit, on {mx.default_device()}: ms per call (median), {args.prompt_tokens}-token prompt"
    )
    print(f"{'':<40} {'engine':>9} {'mlx-lm':>9} {'ratio':>6}")
    for what, mine, yours in profile(model, twin, prompt, args.repeat):
        ratio = f"{yours / mine:6.2f}" if yours == yours and mine > 0 else ""
        print(f"{what:<40} {mine:9.3f} {yours:9.3f} {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
