"""``python -m engine.cli.bench_qmm --shape qwen3-4b --rows 1,2,4,6,8,16``: what a quantized
matrix product of a few rows costs against the floor of reading its weights once.

Decode steps, batch steps and speculative verify passes multiply a handful of rows by
every weight matrix of the model. Memory-bound, each should cost about one read of the
matrix whatever the row count up to 16; a kernel that costs several reads for 2-6 rows is
what makes a verify pass cost several steps and a batch of 8 streams barely faster than one.

For each of the shape's projections (attention's q, the MLP's gate and up as one matrix,
its down) and each row count, the product is timed two ways on random inputs:

- ``single``: one call per evaluation, so the figure includes one launch and one wait (what
  an uncompiled step pays per matrix);
- ``batched``: ``--calls`` independent products in one evaluation, divided by that count
  (the kernel's own time, launches overlapped). They share one weight, which stays in a
  GPU's last-level cache when it fits there (50 MB on an H200): ``--cold-mb M`` gives them
  distinct weights in turn, at least M MB of them, so each product reads its weight from
  memory as a decode step does.

With ``--ours`` the same products also run through this project's kernel
(``models.quantized_matmul_cuda``, CUDA only), timed the same two ways (``ours/s``,
``ours/b``), with the largest difference of its output from MLX's (``max|ours-mlx|``) and
in its first row from a float32 product on the CPU (``max|ours-f32|``, with MLX's own
beside it); ``--mma`` the same for the tensor-core kernel (``models.quantized_mma_cuda``:
``mma/s``, ``mma/b``, 4-bit only). ``--streams`` adds MLX's product with the rows as a batch step of that many
streams hands them over, one row each ([N, 1, K]; ``streams/b``, batched timing).

``floor`` is the matrix's bytes (codes, scales and biases) at the copy bandwidth measured in
the same run (bytes read and written per second, as ``bench --roofline`` measures it).
``--json`` prints every figure as one object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from engine.cli.bench_shapes import SHAPES, attention_heads


def projections(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """name -> (inputs, outputs) of the shape's dense projections."""
    hidden = config["hidden_size"]
    heads, _, head_dim = attention_heads(config)
    inter = config.get("intermediate_size") or config.get("moe_intermediate_size")
    return {
        f"q {hidden}->{heads * head_dim}": (hidden, heads * head_dim),
        f"gate+up {hidden}->{2 * inter}": (hidden, 2 * inter),
        f"down {inter}->{hidden}": (inter, hidden),
    }


def _time(fn: Any, repeat: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # builds the kernel for this shape
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def _batched_and_compiled(product: Any, turns: list[tuple[Any, Any]], repeat: int) -> tuple[float, float]:
    """Microseconds a product of ``turns`` (rows, weight) pairs in one evaluation: called one by
    one, and as one compiled function of the rows (the weights its constants)."""
    import mlx.core as mx

    weights = [w for _, w in turns]
    xs = [x for x, _ in turns]
    compiled = mx.compile(lambda *rows: [product(x, w) for x, w in zip(rows, weights)])
    batched = _time(lambda: [product(x, w) for x, w in turns], repeat)
    return batched / len(turns) * 1e6, _time(lambda: compiled(*xs), repeat) / len(turns) * 1e6


def _max_difference(a: Any, b: Any) -> float:
    import mlx.core as mx

    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def _check_ours(
    kernel: Any, x: Any, q: tuple[Any, ...], group_size: int, bits: int, out: dict, prefix: str, mode: str = "affine"
) -> None:
    """Our kernel's output against MLX's, and its first row against a float32 product on the
    CPU (the referee; one row keeps the CPU's share of the run short)."""
    import mlx.core as mx

    n = x.shape[0]
    wq, scales, biases = q
    quantization = {"group_size": group_size, "bits": bits, "mode": mode}
    ours = kernel.matmul(x, wq, scales, biases, group_size, bits, **_mode_argument(mode))
    theirs = mx.quantized_matmul(x, wq, scales, biases, transpose=True, **quantization)
    with mx.stream(mx.cpu):
        # A float mode's scale bytes stay bytes; affine scales and biases go to float32.
        f32 = [a.astype(mx.float32) if mode == "affine" and a is not None else a for a in (scales, biases)]
        exact = mx.quantized_matmul(x[:1].astype(mx.float32), wq, *f32, transpose=True, **quantization)
    out[f"{prefix}_vs_mlx"][n] = _max_difference(ours, theirs)
    out[f"{prefix}_vs_f32"][n] = _max_difference(ours[:1], exact)
    out["mlx_vs_f32"][n] = _max_difference(theirs[:1], exact)


def _mode_argument(mode: str) -> dict:
    """The float mode for the row kernel's ``matmul`` (the tensor-core kernel takes affine only)."""
    return {} if mode == "affine" else {"mode": mode}


def _our_kernels(ours: bool, tensor_cores: bool) -> list[tuple[str, Any]]:
    """(output key prefix, module) of the kernels asked for: the small-row kernel (``--ours``)
    and the tensor-core one (``--mma``)."""
    from engine.models import quantized_matmul_cuda, quantized_mma_cuda

    return [("ours", quantized_matmul_cuda)] * ours + [("mma", quantized_mma_cuda)] * tensor_cores


def _random_weight(inputs: int, outputs: int, group_size: int, bits: int, mode: str) -> tuple[Any, Any, Any]:
    """A random [outputs, inputs] weight quantized as asked: (codes, scales, biases or None)."""
    import mlx.core as mx

    w = (mx.random.normal((outputs, inputs)) * inputs**-0.5).astype(mx.bfloat16)
    q = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    weight = (q[0], q[1], q[2] if len(q) > 2 else None)
    mx.eval(*(a for a in weight if a is not None))
    return weight


def time_matrix(
    inputs: int,
    outputs: int,
    rows: list[int],
    bits: int,
    group_size: int,
    mode: str,
    calls: int,
    repeat: int,
    ours: bool = False,
    streams: bool = False,
    cold_bytes: int = 0,
    tensor_cores: bool = False,
) -> dict[str, Any]:
    """The matrix's timings (see the module docstring). With ``cold_bytes``, the batched
    products take turns over enough distinct weights to hold that many bytes (at most one per
    call), so each reads its weight from memory rather than from a cache that one weight fits."""
    import mlx.core as mx

    kernels = _our_kernels(ours, tensor_cores)
    weights = [_random_weight(inputs, outputs, group_size, bits, mode)]
    wq, scales, biases = weights[0]
    nbytes = wq.nbytes + scales.nbytes + (0 if biases is None else biases.nbytes)
    copies = min(calls, max(1, -(-cold_bytes // nbytes)))
    weights += [_random_weight(inputs, outputs, group_size, bits, mode) for _ in range(copies - 1)]
    out: dict[str, Any] = {"bytes": nbytes, "weights": copies, "single_us": {}, "batched_us": {}, "compiled_us": {}}
    if streams:
        out["streams_batched_us"] = {}
    for prefix, _ in kernels:
        keys = ("single_us", "batched_us", "compiled_us", "vs_mlx", "vs_f32")
        out.update({f"{prefix}_{k}": {} for k in keys} | {"mlx_vs_f32": {}})
    for n in rows:
        xs = [mx.random.normal((n, inputs)).astype(mx.bfloat16) for _ in range(calls)]
        mx.eval(xs)
        turns = [(x, weights[i % copies]) for i, x in enumerate(xs)]

        def product(x: Any, weight: tuple[Any, Any, Any]) -> Any:
            return mx.quantized_matmul(x, *weight, transpose=True, group_size=group_size, bits=bits, mode=mode)

        out["single_us"][n] = _time(lambda: product(xs[0], weights[0]), repeat) * 1e6
        out["batched_us"][n], out["compiled_us"][n] = _batched_and_compiled(product, turns, repeat)
        if streams:
            out["streams_batched_us"][n] = (
                _time(lambda: [product(x[:, None], w) for x, w in turns], repeat) / calls * 1e6
            )
        for prefix, kernel in kernels:
            if not kernel.fits(
                n,
                inputs,
                outputs,
                bits=bits,
                group_size=group_size,
                mode=mode,
                dtype=mx.bfloat16,
                scales_dtype=scales.dtype,
                has_biases=biases is not None,
            ):
                continue

            def our_product(x: Any, weight: tuple[Any, Any, Any], kernel: Any = kernel) -> Any:
                return kernel.matmul(x, *weight, group_size, bits, **_mode_argument(mode))

            out[f"{prefix}_single_us"][n] = _time(lambda: our_product(xs[0], weights[0]), repeat) * 1e6
            batched, compiled = _batched_and_compiled(our_product, turns, repeat)
            out[f"{prefix}_batched_us"][n], out[f"{prefix}_compiled_us"][n] = batched, compiled
            _check_ours(kernel, xs[0], weights[0], group_size, bits, out, prefix, mode)
    return out


def _print_matrix(name: str, t: dict[str, Any], rows: list[int]) -> None:
    timings = [
        ("single", "single_us"),
        ("batched", "batched_us"),
        ("compiled", "compiled_us"),
        ("streams/b", "streams_batched_us"),
        ("ours/s", "ours_single_us"),
        ("ours/b", "ours_batched_us"),
        ("ours/c", "ours_compiled_us"),
        ("mma/s", "mma_single_us"),
        ("mma/b", "mma_batched_us"),
        ("mma/c", "mma_compiled_us"),
    ]
    for label, key in timings:
        if key in t:
            cells = "".join(f"{t[key][n]:9.1f}" if n in t[key] else f"{'-':>9}" for n in rows)
            print(f"{name:<26}{label:<9}{cells}{t['floor_us']:9.1f}")
    for label, key in (
        ("max|ours-mlx|", "ours_vs_mlx"),
        ("max|ours-f32|", "ours_vs_f32"),
        ("max|mma-mlx|", "mma_vs_mlx"),
        ("max|mma-f32|", "mma_vs_f32"),
        ("max|mlx-f32|", "mlx_vs_f32"),
    ):
        if key in t:
            cells = "".join(f"{t[key][n]:9.2g}" if n in t[key] else f"{'-':>9}" for n in rows)
            print(f"{'':<12}{label:<23}{cells}")


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """The options every kernel microbenchmark takes: how it times, and whether ours too."""
    p.add_argument("--calls", type=int, default=32, help="independent products in one evaluation (batched)")
    p.add_argument("--repeat", type=int, default=5, help="timed evaluations; the best is kept")
    p.add_argument("--copy-mb", type=int, help="buffer size for the bandwidth measurement (1 GiB on a GPU)")
    p.add_argument("--ours", action="store_true", help="also time this project's CUDA kernel (CUDA only)")
    p.add_argument("--json", action="store_true")


def parse_counts(args: argparse.Namespace, flag: str, text: str) -> list[int] | None:
    """``text`` ("1,2,4") as whole numbers of at least 1, with the timing options checked too;
    None after printing a one-line error."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        print(f"error: {flag} takes whole numbers separated by commas, not {text!r}", file=sys.stderr)
        return None
    if not counts or min(counts) < 1 or min(args.calls, args.repeat, args.copy_mb or 1) < 1:
        print(f"error: {flag}, --calls, --repeat and --copy-mb must be at least 1", file=sys.stderr)
        return None
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_qmm", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--rows", default="1,2,4,6,8,16", help="row counts, comma separated")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--mode", choices=["affine", "mxfp4", "mxfp8", "nvfp4"], default="affine")
    p.add_argument("--mma", action="store_true", help="also time the tensor-core kernel (CUDA only; 4-bit)")
    p.add_argument("--streams", action="store_true", help="also time the rows as [N, 1, K], as a batch step hands them")
    p.add_argument(
        "--cold-mb",
        type=int,
        default=0,
        help="batched products take turns over distinct weights holding at least this many MB "
        "(more than the GPU's last-level cache, 50 MB on an H200), so each reads from memory",
    )
    add_timing_arguments(p)
    args = p.parse_args(argv)
    rows = parse_counts(args, "--rows", args.rows)
    if rows is None:
        return 2
    if args.cold_mb < 0:
        print("error: --cold-mb must be 0 or more", file=sys.stderr)
        return 2
    if args.mode != "affine":
        from engine.artifacts.mlx_quant import MODES

        args.bits, args.group_size = MODES[args.mode].default

    import mlx.core as mx

    from engine.cli.roofline import copy_bandwidth
    from engine.models import quantized_matmul_cuda as qmv

    if (args.ours or args.mma) and not qmv.available():
        print("error: --ours and --mma need MLX's CUDA backend on the GPU (the kernels are CUDA only)", file=sys.stderr)
        return 2

    bandwidth = copy_bandwidth(args.copy_mb)
    result: dict[str, Any] = {
        "shape": args.shape,
        "device": str(mx.default_device()),
        "bits": args.bits,
        "group_size": args.group_size,
        "mode": args.mode,
        "bandwidth_bytes_per_s": bandwidth,
        "matrices": {},
    }
    print(
        f"{args.shape}, {args.mode} {args.bits}-bit g{args.group_size} on {mx.default_device()}: "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; microseconds per product, best of {args.repeat}"
    )
    print(f"{'matrix':<26}{'timing':<9}" + "".join(f"{n:>9}" for n in rows) + f"{'floor':>9}")
    for name, (inputs, outputs) in projections(SHAPES[args.shape]).items():
        t = time_matrix(
            inputs,
            outputs,
            rows,
            args.bits,
            args.group_size,
            args.mode,
            args.calls,
            args.repeat,
            args.ours,
            args.streams,
            args.cold_mb << 20,
            args.mma,
        )
        t["floor_us"] = t["bytes"] / bandwidth * 1e6
        result["matrices"][name] = t
        _print_matrix(name, t, rows)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
