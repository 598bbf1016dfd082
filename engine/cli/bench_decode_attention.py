"""``python -m engine.cli.bench_decode_attention --shape qwen3-4b --keys 512,4096 --rows 1,8``:
one layer's decode attention over a KV cache's buffer, as whole 256-token steps leave it and
as the engine's buffers hold it (``kv_cache.buffer_tokens``).

MLX's CUDA attention picks its kernel for a one-query pass by the buffer the keys are sliced
from: cuDNN when that buffer is a multiple of 256 tokens long (mlx-lm's cache), its vector
kernel otherwise. For each number of keys and rows this times the pass both ways (``--calls``
passes in one evaluation, divided; the best of ``--repeat``) with the shape's query and KV
heads, and says which buffer length the engine picks for it. Elsewhere (Metal, the CPU) both
columns take the same kernel.
"""

from __future__ import annotations

import argparse
import json

from engine.cli.bench_qmm import _time, add_timing_arguments, parse_counts
from engine.cli.bench_shapes import SHAPES, attention_heads
from engine.models.kv_cache import SPARE_TOKENS, buffer_tokens, whole_steps


def time_pass(heads: tuple[int, int, int], keys: int, rows: int, length: int, calls: int, repeat: int) -> float:
    """Microseconds of one decode attention pass over ``keys`` of a ``length``-token buffer."""
    import mlx.core as mx

    n_q, n_kv, dim = heads
    q = mx.random.normal((rows, n_q, 1, dim)).astype(mx.bfloat16)
    buffer = mx.random.normal((rows, n_kv, length, dim)).astype(mx.bfloat16)
    mx.eval(q, buffer)
    k = buffer[..., :keys, :]
    scale = dim**-0.5
    best = _time(lambda: [mx.fast.scaled_dot_product_attention(q, k, k, scale=scale) for _ in range(calls)], repeat)
    return 1e6 * best / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.cli.bench_decode_attention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--keys", default="512,1000,4096,8000", help="cached tokens, comma separated")
    p.add_argument("--rows", default="1,2,4,8,16", help="rows (streams of a batch), comma separated")
    add_timing_arguments(p)
    args = p.parse_args(argv)
    keys = parse_counts(args, "--keys", args.keys)
    rows = parse_counts(args, "--rows", args.rows)
    if keys is None or rows is None:
        return 2
    import mlx.core as mx

    heads = attention_heads(SHAPES[args.shape])
    print(f"{args.shape}: {heads[0]} query heads, {heads[1]} KV heads of {heads[2]}, bf16, on {mx.default_device()}")
    results = []
    for n in keys:
        for r in rows:
            whole = whole_steps(n)
            padded = whole + SPARE_TOKENS
            row = {
                "keys": n,
                "rows": r,
                "whole_steps_us": time_pass(heads, n, r, whole, args.calls, args.repeat),
                "padded_us": time_pass(heads, n, r, padded, args.calls, args.repeat),
                "engine_buffer": buffer_tokens(n, rows=r),
            }
            results.append(row)
            picked = "padded" if row["engine_buffer"] != whole else "whole steps"
            print(
                f"keys {n:6d}  rows {r:3d}  whole steps ({whole}) {row['whole_steps_us']:8.1f} us   "
                f"padded ({padded}) {row['padded_us']:8.1f} us   engine: {picked}",
                flush=True,
            )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
