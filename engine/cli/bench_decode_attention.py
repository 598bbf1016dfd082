"""``python -m engine.cli.bench_decode_attention --shape qwen3-4b --keys 512,4096 --rows 1,8``:
one layer's decode attention over a KV cache's buffer, as whole 256-token steps leave it and
as the engine's buffers hold it (``cache_buffers.buffer_tokens``).

MLX's CUDA attention picks its kernel for a one-query pass by the buffer the keys are sliced
from: cuDNN when that buffer is a multiple of 256 tokens long (mlx-lm's cache), its vector
kernel otherwise. For each number of keys and rows this times the pass both ways (``--calls``
passes in one evaluation, divided; the best of ``--repeat``) with the shape's query and KV
heads, and says which buffer length the engine picks for it. Elsewhere (Metal, the CPU) both
columns take the same kernel.

``--chain`` makes each pass's query the previous pass's output, as a step's layers follow
one another: independent passes in one evaluation overlap on the GPU (MLX's one-query kernel
uses 32 blocks of 132 multiprocessors), which a step never lets them do, so only chained
figures say what a step pays. ``--ours`` (CUDA) adds the engine's attention split over the
keys (models.decode_attention_cuda) over the engine's buffer; ``--keys-per-warp 16,32,64``
times it once for each length of a warp's slice (``KEYS_PER_WARP``), to choose it.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.cli.bench_qmm import _time, add_timing_arguments, parse_counts
from engine.cli.bench_shapes import SHAPES, attention_heads
from engine.models.cache_buffers import SPARE_TOKENS, buffer_tokens, whole_steps


def time_pass(
    heads: tuple[int, int, int],
    keys: int,
    rows: int,
    length: int,
    calls: int,
    repeat: int,
    chain: bool = False,
    split: bool = False,
) -> float:
    """Microseconds of one decode attention pass over ``keys`` of a ``length``-token buffer:
    MLX's, or with ``split`` the engine's kernels split over the keys; with ``chain`` each
    pass takes the previous one's output as its query."""
    import mlx.core as mx

    from engine.models import decode_attention_cuda

    n_q, n_kv, dim = heads
    q = mx.random.normal((rows, n_q, 1, dim)).astype(mx.bfloat16)
    buffer = mx.random.normal((rows, n_kv, length, dim)).astype(mx.bfloat16)
    mx.eval(q, buffer)
    k = buffer[..., :keys, :]
    scale = dim**-0.5

    def attend(x: mx.array) -> mx.array:
        if split:
            return decode_attention_cuda.attend(x, k, k, scale)
        return mx.fast.scaled_dot_product_attention(x, k, k, scale=scale)

    def chained() -> list[mx.array]:
        x = q
        for _ in range(calls):
            x = attend(x)
        return [x]

    best = _time(chained if chain else lambda: [attend(q) for _ in range(calls)], repeat)
    return 1e6 * best / calls


def _time_ours(heads, keys: int, rows: int, length: int, timing: dict, keys_per_warp: int | None) -> float:
    """``time_pass`` of the engine's split kernels, a warp's slice ``keys_per_warp`` long
    where given (the planned launches are made again for it)."""
    from engine.models import decode_attention_cuda as ours

    kept = ours.KEYS_PER_WARP
    ours.KEYS_PER_WARP = keys_per_warp or kept
    ours._launches.cache_clear()
    try:
        return time_pass(heads, keys, rows, length, **timing, split=True)
    finally:
        ours.KEYS_PER_WARP = kept
        ours._launches.cache_clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.cli.bench_decode_attention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--keys", default="512,1000,4096,8000", help="cached tokens, comma separated")
    p.add_argument("--rows", default="1,2,4,8,16", help="rows (streams of a batch), comma separated")
    p.add_argument("--chain", action="store_true", help="each pass's query is the previous pass's output")
    p.add_argument("--keys-per-warp", help="with --ours: lengths of a warp's slice to time ours at, comma separated")
    add_timing_arguments(p)
    args = p.parse_args(argv)
    keys = parse_counts(args, "--keys", args.keys)
    rows = parse_counts(args, "--rows", args.rows)
    per_warp = parse_counts(args, "--keys-per-warp", args.keys_per_warp) if args.keys_per_warp else [None]
    if keys is None or rows is None or per_warp is None:
        return 2
    import mlx.core as mx

    from engine.models import decode_attention_cuda

    heads = attention_heads(SHAPES[args.shape])
    split = args.ours and decode_attention_cuda.shared.available()
    if args.ours and not split:
        print("--ours: the split kernels run on MLX's CUDA backend only; timing MLX's alone", file=sys.stderr)
    print(
        f"{args.shape}: {heads[0]} query heads, {heads[1]} KV heads of {heads[2]}, bf16, on {mx.default_device()}"
        f"{', passes chained' if args.chain else ', passes independent'}"
    )
    results = []
    for n in keys:
        for r in rows:
            whole = whole_steps(n)
            padded = whole + SPARE_TOKENS
            timing = {"calls": args.calls, "repeat": args.repeat, "chain": args.chain}
            row = {
                "keys": n,
                "rows": r,
                "whole_steps_us": time_pass(heads, n, r, whole, **timing),
                "padded_us": time_pass(heads, n, r, padded, **timing),
                "engine_buffer": buffer_tokens(n, rows=r),
            }
            ours = ""
            for slice_keys in per_warp if split else []:
                label = "split_us" if slice_keys is None else f"split_{slice_keys}_us"
                row[label] = _time_ours(heads, n, r, row["engine_buffer"], timing, slice_keys)
                ours += f"   split{'' if slice_keys is None else f' ({slice_keys} a warp)'} {row[label]:8.1f} us"
            results.append(row)
            picked = "padded" if row["engine_buffer"] != whole else "whole steps"
            print(
                f"keys {n:6d}  rows {r:3d}  whole steps ({whole}) {row['whole_steps_us']:8.1f} us   "
                f"padded ({padded}) {row['padded_us']:8.1f} us{ours}   engine: {picked}",
                flush=True,
            )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
