"""Registers a thread of a decode step's CUDA kernels as NVIDIA's compiler builds them for sm_90
(no GPU needed, nvcc on PATH): qwen3-4b's products at one row, as MLX builds them (no launch
bounds) and with each build switch, and the split decode attention. The occupancy column is
the warps a multiprocessor holds at that count (65,536 registers, 128-thread blocks, 64 warps
at most). Where cuobjdump is on PATH too, the instructions of the product's K loop, with its
inputs taken as 16-byte aligned (the path a step runs; the other is compiled beside it):
a lane's chunk of 32 codes of its warp's 8 columns (4 with MLX_DESK_QMV_COLUMNS=4) an iteration.

    python tests/gpu/kernel_registers.py

Figures of it: docs/qmv.md, "Registers".
"""

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from engine.models import decode_attention_cuda as dense  # noqa: E402
from engine.models import quantized_matmul_cuda as qmv  # noqa: E402
from engine.models.kernel_switches import reread  # noqa: E402
from tests.engine.models import nvcc_build  # noqa: E402

# qwen3-4b at 4 bits: (inputs, outputs, residual, glu, norm) of each product of a layer, and the head.
PRODUCTS = {
    "norm + q/k/v 2560->6144": (2560, 6144, False, False, True),
    "output 4096->2560 + residual": (4096, 2560, True, False, False),
    "norm + gate/up 2560->19456 + activation": (2560, 19456, False, True, True),
    "down 9728->2560 + residual": (9728, 2560, True, False, False),
    "head 2560->151936": (2560, 151936, False, False, False),
}
SWITCHES = {
    "default (8 columns, one op a code)": {},
    "MLX_DESK_QMV_BOUNDS=0": {qmv.BOUNDS_ENV: "0"},
    "MLX_DESK_QMV_BOUNDS=8": {qmv.BOUNDS_ENV: "8"},
    "MLX_DESK_QMV_PREFETCH=1": {qmv.PREFETCH_ENV: "1"},
    "MLX_DESK_QMV_UNROLL=2": {qmv.UNROLL_ENV: "2"},
    "MLX_DESK_QMV_ONE_OP_CODES=0": {qmv.ONE_OP_ENV: "0"},
    "MLX_DESK_QMV_COLUMNS=4 (two ops a code)": {qmv.COLUMNS_ENV: "4"},
    "MLX_DESK_QMV_COLUMNS=4, ONE_OP_CODES=1": {qmv.COLUMNS_ENV: "4", qmv.ONE_OP_ENV: "1"},
}


def warps(registers: int) -> int:
    blocks = min(65536 // (registers * 128), 16)
    return blocks * 4


def build(source: str) -> tuple[int, int]:
    return nvcc_build.build(Path(tempfile.mkdtemp()), source)


def loop_instructions(source: str) -> str:
    """The K loop's instructions (the longest backward branch's body) and its commonest
    opcodes, with the inputs' alignment checks taken as true; '' without cuobjdump."""
    if shutil.which("cuobjdump") is None:
        return ""
    folder = Path(tempfile.mkdtemp())
    nvcc_build.build(folder, re.sub(r"const bool (\w+_aligned) = [^;]*;", r"const bool \1 = true;", source))
    sass = subprocess.run(["cuobjdump", "-sass", str(folder / "k.cubin")], capture_output=True, text=True).stdout
    found = re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    code = [(int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)) for m in found]
    loop: list[str] = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= address]
            loop = body if len(body) > len(loop) else loop
    common = ", ".join(f"{op} {n}" for op, n in collections.Counter(loop).most_common(4))
    return f" {len(loop)} ({common}) |"


def main() -> None:
    sass = shutil.which("cuobjdump") is not None
    print("| product | build | registers | warps a multiprocessor | spilled bytes |" + (" K loop |" if sass else ""))
    print("| --- | --- | ---: | ---: | ---: |" + (" ---: |" if sass else ""))
    for name, (k, n, residual, glu, norm) in PRODUCTS.items():
        for switch, env in SWITCHES.items():
            for key in (qmv.BOUNDS_ENV, qmv.PREFETCH_ENV, qmv.UNROLL_ENV, qmv.ONE_OP_ENV, qmv.COLUMNS_ENV):
                os.environ.pop(key, None)
            os.environ.update(env)
            reread()  # the kernels keep their first reads
            splits = qmv.k_splits(k, n, 4)
            source = nvcc_build.product(1, splits, residual, glu, norm, qmv.build_switches(), qmv.columns(1))
            registers, spilled = build(source)
            print(f"| {name} | {switch} | {registers} | {warps(registers)} | {spilled} |{loop_instructions(source)}")
    for heads, kv_heads, queries, keys, dims in nvcc_build.PASSES:
        _, slices, blocks = dense.plan(1, heads, kv_heads, queries, keys, dims, mx.bfloat16)
        source = nvcc_build.dense_partial(heads, kv_heads, queries, keys, dims)
        registers, spilled = build(source)
        print(
            f"| split attention, {heads} heads over {kv_heads}, {queries} queries, {keys} keys "
            f"({slices * blocks} warps, a slice each) | as MLX builds it | {registers} | {warps(registers)} | {spilled} |"
        )


if __name__ == "__main__":
    main()
