"""``python -m engine.cli.bench_gather_qmm --shape qwen3.5-35b-a3b --tokens 1,2,4``: what a
mixture-of-experts layer's quantized expert products cost in a decode step, MLX's
``gather_qmm`` beside this project's CUDA kernel (``models.gathered_matmul_cuda``), against
the floor of reading the chosen experts' weights once.

A decode step routes each token to k experts; the gate and up products read the token's
one activation row k times (once per expert), the down product k hidden rows. For each
token count the products are timed as ``bench_qmm`` times them (``single``: one call per
evaluation; ``batched``: ``--calls`` in one, divided), the experts drawn at random, distinct
within a token. ``floor`` is the distinct experts' bytes at the copy bandwidth measured in
the same run. With ``--ours`` (CUDA only) our kernel's times and its largest difference from
MLX's output are printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.cli.bench_qmm import _max_difference, _time, add_timing_arguments, parse_counts
from engine.cli.bench_shapes import SHAPES


def expert_projections(config: dict[str, Any]) -> tuple[int, int, dict[str, tuple[int, int, bool]]]:
    """(experts, experts per token, name -> (inputs, outputs, row shared by a token's experts))."""
    hidden = config["hidden_size"]
    inter = config["moe_intermediate_size"]
    experts = config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"]
    k = config.get("num_experts_per_tok") or config.get("top_k_experts") or config["experts_per_token"]
    return (
        experts,
        k,
        {
            f"gate/up {hidden}->{inter}": (hidden, inter, True),
            f"down {inter}->{hidden}": (inter, hidden, False),
        },
    )


def time_experts(
    experts: int,
    k: int,
    inputs: int,
    outputs: int,
    shared_row: bool,
    tokens: list[int],
    bits: int,
    group_size: int,
    calls: int,
    repeat: int,
    ours: bool,
) -> dict[str, Any]:
    import mlx.core as mx

    from engine.models import gathered_matmul_cuda as gathered

    w = (mx.random.normal((experts, outputs, inputs)) * inputs**-0.5).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(wq, scales, biases)
    per_expert = (wq.nbytes + scales.nbytes + biases.nbytes) // experts
    out: dict[str, Any] = {"bytes_per_expert": per_expert, "floor_bytes": {}, "single_us": {}, "batched_us": {}}
    if ours:
        out.update({key: {} for key in ("ours_single_us", "ours_batched_us", "ours_vs_mlx")})
    for n in tokens:
        draws = [
            mx.argsort(mx.random.uniform(shape=(n, experts)), axis=-1)[:, :k].astype(mx.uint32) for _ in range(calls)
        ]
        rows = (n, 1, 1, 1, inputs) if shared_row else (n, k, 1, inputs)
        xs = [mx.random.normal(rows).astype(mx.bfloat16) for _ in range(calls)]
        mx.eval(draws, xs)
        distinct = len(set(draws[0].reshape(-1).tolist()))
        out["floor_bytes"][n] = distinct * per_expert
        ids = [d.reshape(n, 1, k) if shared_row else d for d in draws]

        def theirs(i: int) -> Any:
            return mx.gather_qmm(
                xs[i], wq, scales, biases, rhs_indices=ids[i], transpose=True, group_size=group_size, bits=bits
            )

        out["single_us"][n] = _time(lambda: theirs(0), repeat) * 1e6
        out["batched_us"][n] = _time(lambda: [theirs(i) for i in range(calls)], repeat) / calls * 1e6
        if not ours:
            continue
        shares = gathered.gather_shares(xs[0].shape[:-2], ids[0].shape)

        def mine(i: int) -> Any:
            return gathered.gathered_matmul(xs[i], wq, scales, biases, ids[i], shares, group_size, bits)

        out["ours_single_us"][n] = _time(lambda: mine(0), repeat) * 1e6
        out["ours_batched_us"][n] = _time(lambda: [mine(i) for i in range(calls)], repeat) / calls * 1e6
        out["ours_vs_mlx"][n] = _max_difference(mine(0), theirs(0))
    return out


def _print(name: str, t: dict[str, Any], tokens: list[int], bandwidth: float) -> None:
    for label, key in (
        ("single", "single_us"),
        ("batched", "batched_us"),
        ("ours/s", "ours_single_us"),
        ("ours/b", "ours_batched_us"),
    ):
        if key in t:
            cells = "".join(f"{t[key][n]:9.1f}" for n in tokens)
            print(f"{name:<24}{label:<9}{cells}")
    print(f"{name:<24}{'floor':<9}" + "".join(f"{t['floor_bytes'][n] / bandwidth * 1e6:9.1f}" for n in tokens))
    if "ours_vs_mlx" in t:
        print(f"{'':<12}{'max|ours-mlx|':<21}" + "".join(f"{t['ours_vs_mlx'][n]:9.2g}" for n in tokens))


def expert_parser(module: str, doc: str, shape: str, tokens: str) -> argparse.ArgumentParser:
    """The options an expert microbenchmark starts from: a MoE shape, tokens a pass, the quantization."""
    moe = sorted(name for name, config in SHAPES.items() if "moe_intermediate_size" in config)
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    p.add_argument("--shape", choices=moe, default=shape)
    p.add_argument("--tokens", default=tokens, help="tokens per pass, comma separated")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    p = expert_parser("engine.cli.bench_gather_qmm", __doc__, "qwen3.5-35b-a3b", "1,2,4")
    add_timing_arguments(p)
    args = p.parse_args(argv)
    tokens = parse_counts(args, "--tokens", args.tokens)
    if tokens is None:
        return 2

    import mlx.core as mx

    from engine.cli.roofline import copy_bandwidth
    from engine.models import quantized_matmul_cuda as qmv

    if args.ours and not qmv.available():
        print("error: --ours needs MLX's CUDA backend on the GPU (the kernel is CUDA only)", file=sys.stderr)
        return 2
    experts, k, products = expert_projections(SHAPES[args.shape])
    bandwidth = copy_bandwidth(args.copy_mb)
    result: dict[str, Any] = {
        "shape": args.shape,
        "experts": experts,
        "k": k,
        "bandwidth_bytes_per_s": bandwidth,
        "products": {},
    }
    print(
        f"{args.shape}: {experts} experts, {k} a token, affine {args.bits}-bit g{args.group_size} on "
        f"{mx.default_device()}: copy bandwidth {bandwidth / 1e9:.1f} GB/s; microseconds per product, best of {args.repeat}"
    )
    print(f"{'product':<24}{'timing':<9}" + "".join(f"{n:>8}t" for n in tokens))
    for name, (inputs, outputs, shared_row) in products.items():
        t = time_experts(
            experts,
            k,
            inputs,
            outputs,
            shared_row,
            tokens,
            args.bits,
            args.group_size,
            args.calls,
            args.repeat,
            args.ours,
        )
        result["products"][name] = t
        _print(name, t, tokens, bandwidth)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
