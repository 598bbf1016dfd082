"""``python -m engine.cli.bench_verify --shape qwen3.5-4b``: does a multi-token pass (a
speculative verification) compute what single decode steps compute, layer by layer?
(Hybrid Qwen3.5 shapes and latent-attention ones: ``moonlight-16b-a3b``, ``tiny-mla``.)

Speculative greedy decoding is exact only if the logits of a verify pass over n tokens
equal the logits of n single steps. Kernels differ between the two (a matrix product
over n rows instead of one, attention over n queries), so the two agree to bf16
rounding, not bitwise; a kernel that is wrong for one of the two shows up as a layer
whose difference is far above that.

Each layer is compared with the same input on both sides (the inputs the single steps
gave it), so differences do not compound: one row per layer and per op inside it (the
causal convolution, the gated delta rule, attention), as max |a - b| over max |a|.
bf16 rounding is about 4e-3; a few times that is noise, 1e-1 and above is a bug.

``--primitives`` asks the backend itself: each MLX primitive a decode step runs, at the
shape's sizes, called once on n rows and n times on one row (an attention query over
exactly the keys its step sees, a recurrence one token at a time). Where a primitive's row
differs from its one-row call, no formulation of ours can make a verify pass give a step's
numbers short of running it row by row (on CUDA, a matmul of one row runs a matrix-vector
kernel and of several a cuBLAS or tiled quantized one, which sum in another order).
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
    from engine.models import gated_delta, mla, qwen3_5, routed_moe
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
        # Latent attention (DeepSeek V3, Moonlight): the absorbed form's result, still per head.
        "latent attention": (_Tap(mla.MLAttention, "latent_attention"), -2),
        "router weights": (_Tap(routed_moe.GroupLimitedRouter, "__call__", lambda out: out[1]), 1),
        "experts": (_Tap(routed_moe.RoutedMoE, "__call__"), 1),
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


def _rows_equal(name: str, many: Any, rows: list[Any], axis: int) -> tuple[str, bool, float]:
    """(name, whether the n-row call's rows equal the one-row calls' bitwise, relative difference)."""
    import mlx.core as mx

    ones = mx.concatenate(rows, axis=axis)
    return name, bool(mx.array_equal(many, ones).item()), _rel(ones, many)


def primitives(shape: dict[str, Any], n: int, context: int, bits: int = 4) -> list[tuple[str, bool, float]]:
    """Each primitive a decode step of ``shape`` runs, called on ``n`` rows at once against
    ``n`` one-row calls (after ``context`` cached positions where it attends): (what, rows
    bitwise equal, relative difference). A primitive the backend does not offer for these
    inputs (bf16 gather_mm on the CPU build) is left out."""
    import types

    import mlx.core as mx
    import mlx.nn as nn

    from engine.models import mla
    from engine.models.switch import SwitchLinear

    keys = iter(mx.random.split(mx.random.key(3), 64))

    def rnd(*dims: int, scale: float = 1.0, dtype: Any = mx.bfloat16) -> Any:
        return (scale * mx.random.normal(dims, key=next(keys))).astype(dtype)

    hidden = int(shape["hidden_size"])
    inner = int(shape.get("intermediate_size") or shape.get("moe_intermediate_size"))
    heads = int(shape["num_attention_heads"])
    x = rnd(1, n, hidden)
    w = rnd(inner, hidden, scale=hidden**-0.5)
    per_row = lambda f: [f(x[:, t : t + 1]) for t in range(n)]  # noqa: E731
    out = [_rows_equal(f"matmul bf16 [{n}, {hidden}] x [{hidden}, {inner}]", x @ w.T, per_row(lambda r: r @ w.T), 1)]
    wq, scales, biases = mx.quantize(w, 64, bits)
    qmm = lambda r: mx.quantized_matmul(r, wq, scales, biases, transpose=True, group_size=64, bits=bits)  # noqa: E731
    out.append(_rows_equal(f"quantized_matmul {bits}-bit g64, same sizes", qmm(x), per_row(qmm), 1))
    experts = int(shape.get("n_routed_experts") or shape.get("num_experts") or 64)
    router = rnd(experts, hidden, scale=hidden**-0.5, dtype=mx.float32)
    route = lambda r: r.astype(mx.float32) @ router.T  # noqa: E731
    out.append(
        _rows_equal(f"matmul float32 (router) [{n}, {hidden}] x [{hidden}, {experts}]", route(x), per_row(route), 1)
    )
    norm_w = rnd(hidden, scale=0.1) + 1
    rms = lambda r: mx.fast.rms_norm(r, norm_w, 1e-6)  # noqa: E731
    out.append(_rows_equal("rms_norm", rms(x), per_row(rms), 1))

    head_dim = int(shape.get("head_dim") or shape.get("qk_rope_head_dim") or hidden // heads)
    q = rnd(1, heads, n, head_dim)
    rope = lambda r, at: mx.fast.rope(r, head_dim, traditional=False, base=1e4, scale=1.0, offset=at)  # noqa: E731
    out.append(_rows_equal("rope", rope(q, context), [rope(q[:, :, t : t + 1], context + t) for t in range(n)], 2))
    total = context + n
    if "kv_lora_rank" in shape:  # latent attention: the engine's absorbed form, as it runs here
        rank, rope_dims = int(shape["kv_lora_rank"]), int(shape["qk_rope_head_dim"])
        q_latent, q_pe = rnd(1, heads, n, rank), rnd(1, heads, n, rope_dims)
        latent, k_pe = rnd(1, 1, total, rank), rnd(1, 1, total, rope_dims)
        owner = types.SimpleNamespace(scale=(rank + rope_dims) ** -0.5)
        owner.rope_scores = lambda *a, **kw: mla.MLAttention.rope_scores(owner, *a, **kw)

        def absorbed(t: int | None) -> Any:
            if t is None:
                keep = mla.causal_keep("causal", n, total)
                return mla.MLAttention.latent_attention(owner, q_latent, q_pe, latent, k_pe, keep)
            end = total - n + t + 1
            one = [a[:, :, t : t + 1] for a in (q_latent, q_pe)]
            return mla.MLAttention.latent_attention(owner, *one, latent[:, :, :end], k_pe[:, :, :end], None)

        chosen_form = mla.COMPOSE
        try:
            for composed in (True, False):  # this backend's choice is mla.composed_latent_attention()
                mla.COMPOSE = composed
                name = f"latent attention ({'composed' if composed else 'fused'}), {n} masked queries vs each alone"
                out.append(_rows_equal(name, absorbed(None), [absorbed(t) for t in range(n)], 2))
        finally:
            mla.COMPOSE = chosen_form
    else:
        kv_heads = int(shape.get("num_key_value_heads") or heads)
        k, v = rnd(1, kv_heads, total, head_dim), rnd(1, kv_heads, total, head_dim)
        scale = head_dim**-0.5
        many = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        rows = [
            mx.fast.scaled_dot_product_attention(
                q[:, :, t : t + 1], k[:, :, : total - n + t + 1], v[:, :, : total - n + t + 1], scale=scale
            )
            for t in range(n)
        ]
        out.append(_rows_equal(f"sdpa head_dim {head_dim}, {n} causal queries vs each over its keys", many, rows, 2))
    if "linear_conv_kernel_dim" in shape:  # gated DeltaNet
        kernel = int(shape["linear_conv_kernel_dim"])
        dk, dv = int(shape["linear_key_head_dim"]), int(shape["linear_value_head_dim"])
        hk, hv = int(shape["linear_num_key_heads"]), int(shape["linear_num_value_heads"])
        channels = 2 * dk * hk + dv * hv
        conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)
        conv.set_dtype(mx.bfloat16)
        padded = rnd(1, kernel - 1 + n, channels)
        windows = [conv(padded[:, t : t + kernel]) for t in range(n)]
        out.append(_rows_equal(f"depthwise conv1d, {n} windows in one call", conv(padded), windows, 1))
        qk = [rnd(1, n, hk, dk, dtype=mx.float32) for _ in range(2)]
        qk = [a * mx.rsqrt((a * a).sum(-1, keepdims=True)) for a in qk]
        v, g, beta = rnd(1, n, hv, dv, dtype=mx.float32), mx.sigmoid(rnd(1, n, hv)), mx.sigmoid(rnd(1, n, hv))
        state = rnd(1, hv, dv, dk, scale=0.1, dtype=mx.float32)
        many, _ = mx.fast.gated_delta_update(qk[0], qk[1], v, g.astype(mx.float32), beta.astype(mx.float32), state)
        rows = []
        for t in range(n):
            step = [a[:, t : t + 1] for a in (qk[0], qk[1], v, g.astype(mx.float32), beta.astype(mx.float32))]
            y, state = mx.fast.gated_delta_update(*step, state)
            rows.append(y)
        out.append(_rows_equal(f"gated_delta_update, {n} tokens in one call", many, rows, 1))
    top_k = int(shape.get("num_experts_per_tok") or 0)
    if top_k:
        expert_dim = int(shape.get("moe_intermediate_size") or inner)
        linear = SwitchLinear(hidden, expert_dim, experts)
        linear.set_dtype(mx.bfloat16)
        chosen = mx.argsort(rnd(n, experts, dtype=mx.float32), axis=-1)[:, :top_k].astype(mx.uint32)
        xs = mx.expand_dims(x[0], (-2, -3))  # [n, 1, 1, hidden], as SwitchGLU feeds it
        for label, layer in (("bf16", linear), (f"{bits}-bit", linear.to_quantized(64, bits))):
            try:
                many = layer(xs, chosen)
                rows = [layer(xs[t : t + 1], chosen[t : t + 1]) for t in range(n)]
                out.append(_rows_equal(f"experts ({label}), {n} tokens x top-{top_k} of {experts}", many, rows, 0))
            except (ValueError, RuntimeError) as why:  # not offered on this backend
                out.append((f"experts ({label}): not run here ({str(why).splitlines()[0][:60]})", True, 0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    from engine.cli.bench import SHAPES, build_model

    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_verify", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape", default="tiny-qwen3.5", choices=[s for s in SHAPES if "qwen3" in s or "mla" in s or "moonlight" in s]
    )
    p.add_argument("--bits", type=int, default=16, help="16 (bf16, default), 8 or 4")
    p.add_argument("--layers", type=int, help="keep only the first N layers (fewer on a CPU)")
    p.add_argument("--vocab", type=int, help="a smaller vocabulary (fewer on a CPU)")
    p.add_argument("-p", "--prompt-tokens", type=int, default=64)
    p.add_argument("-n", "--tokens", type=int, default=5, help="tokens in the verify pass (default 5)")
    p.add_argument("--compiled", action="store_true", help="also check the compiled decode step (GPU decoding)")
    p.add_argument(
        "--rows-alone",
        action="store_true",
        help="run each row of the verify pass alone, as a step does (engine/cli/verify_rows.py)",
    )
    p.add_argument(
        "--primitives",
        action="store_true",
        help="check each MLX primitive a step runs, n rows at once against n one-row calls (no model built)",
    )
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.primitives:
        bits = 4 if args.bits == 16 else args.bits
        print(f"{args.shape} primitives on {mx.default_device()}: {args.tokens} rows after {args.prompt_tokens}")
        for what, same, rel in primitives(shape, args.tokens, args.prompt_tokens, bits):
            print(f"{what:<72} {'equal' if same else 'DIFFERS'} {rel:.2e}", flush=True)
        return 0
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
    from contextlib import nullcontext

    from engine.cli.verify_rows import rows_alone

    with rows_alone() if args.rows_alone else nullcontext():
        rows = compare(model, ids[: args.prompt_tokens], ids[args.prompt_tokens :], args.compiled)
    for what, rel in rows:
        print(f"{what:<28} {rel:.2e}" if rel or "argmax" not in what else what, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
