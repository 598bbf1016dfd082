"""``python -m engine.cli.bench_expert_blocks --shape diffusion-gemma-26b-a4b --tokens 64,256,1024``:
what one MoE block's expert products cost in a long pass (a prompt, a DiffusionGemma canvas),
its pairs sorted by expert, taken pair by pair as MLX's expert product runs them against
blocks of one expert (``models/expert_blocks.py``) of each height, against the floor of
reading the chosen experts once (``auto``: the height the engine takes on CUDA, or ``pair``
where it keeps pair by pair).

One quantized expert block of the shape (gate and up stacked, as the engine holds them, and
down) gets ``tokens`` tokens routed at random to k distinct experts each. Each layout is timed
as one evaluation of the block's output, the best of ``--repeat``; every layout's output is
compared with the pair-by-pair one (the largest difference is printed). ``floor`` is the
chosen experts' bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from engine.cli.bench_gather_qmm import expert_parser, expert_projections
from engine.cli.bench_qmm import _max_difference, _time, parse_counts
from engine.cli.bench_shapes import SHAPES

HEIGHTS = (16, 32, 64)


def _block(config: dict[str, Any], bits: int, group_size: int) -> tuple[Any, int, int]:
    """A quantized expert block of ``config``'s dimensions (gate and up stacked), its experts and k."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.models.stacked import stack_projections
    from engine.models.switch import SwitchGLU

    experts, k, _ = expert_projections(config)
    block = SwitchGLU(config["hidden_size"], config["moe_intermediate_size"], experts)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, group_size=group_size, bits=bits)
    stack_projections(block)
    mx.eval(block.parameters())
    return block, experts, k


def _expert_bytes(block: Any) -> int:
    """One expert's bytes over the three projections (codes, scales, biases)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes // v.shape[0] for _, v in tree_flatten(block.parameters()) if v.ndim >= 2)


def time_layouts(block: Any, experts: int, k: int, tokens: int, repeat: int) -> dict[str, Any]:
    """Microseconds for one pass of ``tokens`` through ``block`` in each layout, with each
    layout's largest difference from the pair-by-pair output."""
    import mlx.core as mx

    from engine.models.expert_blocks import enough_pairs, rows_per_block

    dims = block.down_proj["weight"].shape[1]  # the block's input width (down's output)
    key_x, key_ids = mx.random.split(mx.random.key(tokens))
    x = mx.random.normal((tokens, dims), key=key_x).astype(mx.bfloat16)
    ids = mx.argsort(mx.random.uniform(shape=(tokens, experts), key=key_ids), axis=-1)[:, :k].astype(mx.int32)
    mx.eval(x, ids)

    def pair_by_pair() -> Any:  # as ``SwitchGLU.routed`` runs a long pass off CUDA
        return block.sorted_pairs(x, ids)

    reference = pair_by_pair()
    mx.eval(reference)
    layouts = {"pair by pair": pair_by_pair}
    for rows in HEIGHTS:
        layouts[f"blocks of {rows}"] = lambda rows=rows: block.blocked(x, ids, rows)
    # The engine's choice on CUDA: blocks of this height, or 0 for pair by pair.
    chosen = rows_per_block(tokens * k, experts) if enough_pairs(tokens * k, experts) else 0
    hit = len(set(ids.flatten().tolist()))
    out: dict[str, Any] = {"tokens": tokens, "experts_hit": hit, "chosen_rows": chosen, "us": {}, "max_difference": {}}
    for name, fn in layouts.items():
        out["us"][name] = 1e6 * _time(fn, repeat)
        out["max_difference"][name] = _max_difference(fn(), reference)
    return out


def main(argv: list[str] | None = None) -> int:
    p = expert_parser("engine.cli.bench_expert_blocks", __doc__, "diffusion-gemma-26b-a4b", "64,256,1024")
    p.add_argument("--repeat", type=int, default=5, help="timed evaluations; the best is kept")
    p.add_argument("--copy-mb", type=int, help="buffer size for the bandwidth measurement (1 GiB on a GPU)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.calls = 1  # parse_counts checks the timing options every microbenchmark shares
    tokens = parse_counts(args, "--tokens", args.tokens)
    if tokens is None:
        return 2

    import mlx.core as mx

    from engine.cli.roofline import copy_bandwidth

    block, experts, k = _block(SHAPES[args.shape], args.bits, args.group_size)
    bandwidth = copy_bandwidth(args.copy_mb)
    per_expert = _expert_bytes(block)
    print(
        f"{args.shape}: {experts} experts, {k} a token, affine {args.bits}-bit g{args.group_size} on "
        f"{mx.default_device()}: copy bandwidth {bandwidth / 1e9:.1f} GB/s; microseconds per block pass, "
        f"best of {args.repeat}"
    )
    names = ["pair by pair"] + [f"blocks of {r}" for r in HEIGHTS]
    print(f"{'tokens':>7}{'hit':>5}{'auto':>6}" + "".join(f"{n:>15}" for n in names) + f"{'floor':>10}")
    result: dict[str, Any] = {
        "shape": args.shape,
        "experts": experts,
        "k": k,
        "bandwidth_bytes_per_s": bandwidth,
        "passes": [],
    }
    for n in tokens:
        t = time_layouts(block, experts, k, n, args.repeat)
        t["floor_us"] = 1e6 * t["experts_hit"] * per_expert / bandwidth
        result["passes"].append(t)
        print(
            f"{n:>7}{t['experts_hit']:>5}{t['chosen_rows'] or 'pair':>6}"
            + "".join(f"{t['us'][name]:>15.1f}" for name in names)
            + f"{t['floor_us']:>10.1f}"
        )
        worst = max(t["max_difference"].values())
        print(f"{'':>18}largest difference from pair by pair: {worst:.3g}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
