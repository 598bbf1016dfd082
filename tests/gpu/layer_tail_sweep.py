"""A layer's tail in one launch (models.layer_tail_cuda) against its three launches, timed as a
decode step sees them: a chain of 36 layers of qwen3-4b's or llama3-8b's widths, each with its
own weights (read from memory, not the L2 cache), one token; for a few grids and column
counts. Microseconds a layer, medians of 7 chains (the first two left out), and the weight
read's floor at the copy rate measured in the same run.

    PYTHONPATH=. python3 tests/gpu/layer_tail_sweep.py [qwen3-4b|llama3-8b]

Needs MLX's CUDA build on a GPU of compute capability 9 or more.
"""

import os
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn

from engine.cli.roofline import copy_bandwidth
from engine.models import layer_tail_cuda as tail
from engine.models import quantized_matmul_cuda as products

WIDTHS = {"qwen3-4b": (4096, 2560, 9728), "llama3-8b": (4096, 4096, 14336)}
# (blocks a multiprocessor, warps a block, columns a warp in the output and down products, in
# gate/up, the most warps splitting K); more than one block a multiprocessor only where
# registers allow, so those last (the run's timeout stops a grid that does not fit)
GRIDS = [
    (1, 8, 2, 4, 4),
    (1, 8, 2, 4, 1),
    (1, 8, 4, 4, 4),
    (1, 16, 4, 4, 4),
    (1, 16, 2, 4, 4),
    (1, 32, 4, 4, 4),
    (1, 32, 4, 4, 2),
    (2, 16, 4, 4, 4),
]
LAYERS = 36
# SWEEP_EACH=1: each layer evaluated alone (no chain handed over at once); SWEEP_GRIDS=N: the first N grids
EACH = os.environ.get("SWEEP_EACH") == "1"
GRIDS = GRIDS[: int(os.environ.get("SWEEP_GRIDS", len(GRIDS)))]


def quantized(inputs: int, outputs: int) -> nn.QuantizedLinear:
    layer = nn.Linear(inputs, outputs, bias=False)
    layer.weight = (mx.random.normal((outputs, inputs)) * inputs**-0.5).astype(mx.bfloat16)
    return nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4)


class Holder:
    pass


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b"
    heads_width, hidden, intermediate = WIDTHS[shape]
    layers = []
    for _ in range(LAYERS):
        o_proj, gate_up, down = (
            quantized(heads_width, hidden),
            quantized(hidden, 2 * intermediate),
            quantized(intermediate, hidden),
        )
        norm = nn.RMSNorm(hidden)
        norm.weight = mx.ones((hidden,), mx.bfloat16)
        layers.append((o_proj, norm, (gate_up["weight"], gate_up["scales"], gate_up["biases"]), down, Holder()))
        mx.eval(o_proj.parameters(), gate_up.parameters(), down.parameters(), norm.weight)
    attn = mx.random.normal((1, 1, heads_width)).astype(mx.bfloat16)
    x0 = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)

    def apart(x, layer):
        o_proj, norm, gate_up, down, _ = layer
        h = products.matmul(attn, o_proj["weight"], o_proj["scales"], o_proj["biases"], 64, 4, residual=x)
        a = products.matmul(h, *gate_up, 64, 4, glu=True, norm=(norm.weight, norm.eps))
        return products.matmul(a, down["weight"], down["scales"], down["biases"], 64, 4, residual=h)

    def together(x, layer):
        o_proj, norm, gate_up, down, holder = layer
        return tail.layer_tail(attn, x, o_proj, norm, gate_up, down, holder)

    def timed(step) -> float:
        runs = []
        for _ in range(7):
            mx.synchronize()
            start = time.perf_counter()
            x = x0
            for layer in layers:
                x = step(x, layer)
                if EACH:
                    mx.eval(x)
            mx.eval(x)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs[2:]) / LAYERS * 1e6

    layer_bytes = sum(
        a.nbytes for a in (*layers[0][0].parameters().values(), *layers[0][2], *layers[0][3].parameters().values())
    )
    rate = copy_bandwidth()
    print(
        f"{shape}: {layer_bytes / 1e6:.1f} MB a layer's tail, floor {layer_bytes / rate * 1e6:.1f} us at {rate / 1e9:.0f} GB/s"
    )
    print(f"three launches            {timed(apart):7.1f} us a layer")
    print(f"{tail.multiprocessors()} multiprocessors")
    for per, warps, columns, glu_columns, split in GRIDS:
        tail.BLOCKS_PER_MULTIPROCESSOR, tail.WARPS, tail.COLUMNS, tail.GLU_COLUMNS = per, warps, columns, glu_columns
        tail.SPLIT = split
        tail._kernel.cache_clear()
        print(
            f"one launch {tail.blocks():3d}x{warps:2d}, {columns}/{glu_columns}, K split {split} {timed(together):7.1f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
