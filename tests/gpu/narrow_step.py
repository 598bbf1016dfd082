"""``python -m engine`` with one more bench shape, ``qwen3-4b-narrow``: qwen3-4b's decode step
(36 layers, the same kernels and ops) on matrices 512 wide, with every product routed to our
kernels as the wide ones are. Its step costs what the ops cost with next to nothing to read,
which tells a step bound by its op count from one bound by its weight read (docs/qmv.md).

    python3 tests/gpu/narrow_step.py bench --shape qwen3-4b-narrow --bits 4 -p 512 -g 64 --step
"""

import runpy
import sys

from engine.cli.bench_shapes import SHAPES
from engine.models import quantized_routing

SHAPES["qwen3-4b-narrow"] = {
    **SHAPES["qwen3-4b"],
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "vocab_size": 8192,
}
quantized_routing.ONE_ROW_MIN_WEIGHTS = quantized_routing.ONE_ROW_FUSED_MIN_WEIGHTS = 0
sys.argv = ["engine", *sys.argv[1:]]
runpy.run_module("engine", run_name="__main__", alter_sys=True)
