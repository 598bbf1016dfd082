"""``python -m engine.cli.bench_verify --shape qwen3.5-4b``: does a multi-token pass (a
speculative verification) compute what single decode steps compute, layer by layer?

Speculative greedy decoding is exact only if the logits of a verify pass over n tokens
equal the logits of n single steps. Kernels differ between the two (a matrix product
over n rows instead of one, attention over n queries), so the two agree to bf16
rounding, not bitwise; a kernel that is wrong for one of the two shows up as a layer
whose difference is far above that.

Each layer is compared with the same input on both sides (the inputs the single steps
gave it), so differences do not compound: one row per layer and per op inside it (the
causal convolution, the gated delta rule, attention), as max |a - b| over max |a|.
bf16 rounding is about 4e-3; a few times that is noise, 1e-1 and above is a bug.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _rel(a: Any, b: Any) -> float:
    import mlx.core as mx

    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(a).max(), 1e-12)).item()


class _Tap:
    """Records what a module-level function returns, per call, while active."""

    def __init__(self, module: Any, name: str, pick=lambda out: out):
        self.module, self.name, self.pick = module, name, pick
        self.original = getattr(module, name)
        self.calls: list[Any] = []

    def __enter__(self) -> _Tap:
        def wrapped(*args, **kwargs):
            out = self.original(*args, **kwargs)
            self.calls.append(self.pick(out))
            return out

        setattr(self.module, self.name, wrapped)
        return self

    def __exit__(self, *_: Any) -> None:
        setattr(self.module, self.name, self.original)


def compare(model: Any, prompt: Any, tokens: Any, compiled: bool = False) -> list[tuple[str, float]]:
    """(what, relative difference) for every layer and the ops inside it, then the logits;
    with ``compiled``, also the compiled decode step's verify pass against its single steps."""
    import mlx.core as mx

    from engine.decode.compiled_hybrid import compiled_decoder
    from engine.models import gated_delta, qwen3_5
    from engine.models.kv_cache import make_prompt_cache
    from engine.models.recurrent_cache import RecurrentCache

    def primed() -> list:
        cache = make_prompt_cache(model)
        model(prompt[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    stack = model.model
    n = int(tokens.size)
    steps_cache, verify_cache = primed(), primed()
    # Ops inside a layer, each with the axis its outputs concatenate along over tokens.
    taps = {
        "conv": (_Tap(gated_delta, "conv_after", lambda out: out[0]), 1),
        "delta rule": (_Tap(mx.fast, "gated_delta_update", lambda out: out[0]), 1),
        "attention": (_Tap(qwen3_5, "sdpa"), -2),
    }

    def run_layer(layer: Any, x: Any, c: Any) -> tuple[Any, dict[str, Any]]:
        for tap, _ in taps.values():
            tap.__enter__()
        try:
            out = layer(x, c.make_mask(int(x.shape[1]), None), c)
        finally:
            for tap, _ in taps.values():
                tap.__exit__()
        seen = {name: mx.concatenate(tap.calls, axis=axis) for name, (tap, axis) in taps.items() if tap.calls}
        for tap, _ in taps.values():
            tap.calls = []
        mx.eval(out, seen)
        return out, seen

    inputs: list[list[Any]] = [[] for _ in stack.layers]
    outputs: list[list[Any]] = [[] for _ in stack.layers]
    inner: list[list[dict[str, Any]]] = [[] for _ in stack.layers]
    states: list[list[list[Any]]] = [[] for _ in stack.layers]  # recurrent layers' after each step
    step_logits = []
    for t in range(n):
        h = stack.embed(tokens[None, t : t + 1])
        for i, (layer, c) in enumerate(zip(stack.layers, steps_cache)):
            inputs[i].append(h)
            h, seen = run_layer(layer, h, c)
            inner[i].append(seen)
            outputs[i].append(h)
            if isinstance(c, RecurrentCache):
                states[i].append(list(c.arrays))
        step_logits.append(model.logits(stack.norm(h)))
    rows: list[tuple[str, float]] = []
    for i, (layer, c) in enumerate(zip(stack.layers, verify_cache)):
        out, seen = run_layer(layer, mx.concatenate(inputs[i], axis=1), c)
        for name, got in seen.items():
            want = mx.concatenate([step[name] for step in inner[i]], axis=taps[name][1])
            rows.append((f"layer {i:2d} {name}", _rel(want, got)))
        rows.append((f"layer {i:2d} output", _rel(mx.concatenate(outputs[i], axis=1), out)))
        if states[i]:
            # Roll the verify pass back one token at a time (rejected drafts), comparing
            # the restored conv and recurrent states with the steps' states there.
            worst = max(_rel(states[i][-1][j], c.arrays[j]) for j in range(len(c.arrays)))
            for back in range(1, n):
                c.trim(1)
                want = states[i][n - 1 - back]
                worst = max([worst] + [_rel(want[j], c.arrays[j]) for j in range(len(c.arrays))])
            rows.append((f"layer {i:2d} state, rolled back", worst))
    verify_logits = model(tokens[None], cache=primed())[0]
    rows.append(("logits (whole pass)", _rel(mx.concatenate(step_logits, axis=1)[0], verify_logits)))
    a = mx.concatenate(step_logits, axis=1)[0].argmax(-1).tolist()
    b = verify_logits.argmax(-1).tolist()
    rows.append((f"argmax equal {sum(x == y for x, y in zip(a, b))}/{n}", 0.0))
    decoder = compiled_decoder(model) if compiled else None
    if decoder is not None and decoder.prepare():
        # The compiled decoder (what decoding on a GPU runs): its steps against its verify pass.
        cache = primed()
        steps = mx.concatenate([decoder(tokens[t : t + 1], cache) for t in range(n)])
        verify = decoder(tokens, primed())
        rows.append(("compiled logits (verify)", _rel(steps, verify)))
        rows.append(("compiled vs plain steps", _rel(mx.concatenate(step_logits, axis=1)[0], steps)))
    return rows


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    from engine.cli.bench import SHAPES, build_model

    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny-qwen3.5", choices=[s for s in SHAPES if "qwen3" in s])
    p.add_argument("--bits", type=int, default=16, help="16 (bf16, default), 8 or 4")
    p.add_argument("--layers", type=int, help="keep only the first N layers (fewer on a CPU)")
    p.add_argument("--vocab", type=int, help="a smaller vocabulary (fewer on a CPU)")
    p.add_argument("-p", "--prompt-tokens", type=int, default=64)
    p.add_argument("-n", "--tokens", type=int, default=5, help="tokens in the verify pass (default 5)")
    p.add_argument("--compiled", action="store_true", help="also check the compiled decode step (GPU decoding)")
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.vocab:
        shape["vocab_size"] = args.vocab
    name = f"{args.shape} (checked)"
    SHAPES[name] = shape
    model, _, _ = build_model(name, args.bits, 64)
    vocab = int(shape["vocab_size"])
    ids = mx.random.randint(0, vocab, (args.prompt_tokens + args.tokens,), key=mx.random.key(7))
    print(f"{args.shape} on {mx.default_device()}: {args.tokens} tokens after {args.prompt_tokens}", flush=True)
    for what, rel in compare(model, ids[: args.prompt_tokens], ids[args.prompt_tokens :], args.compiled):
        print(f"{what:<28} {rel:.2e}" if rel or "argmax" not in what else what, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
