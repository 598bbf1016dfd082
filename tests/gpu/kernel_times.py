"""Each kernel's own time in the last decode steps, from Nsight Compute's raw CSV page: a
step's kernels found as the period the run's tail repeats with, then time a step by kernel.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
        --page raw python3 -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 8 > ncu.csv
    python3 tests/gpu/kernel_times.py ncu.csv [steps]

Figures of it: docs/qmv.md, "MLX's CUDA graphs".
"""

import collections
import csv
import re
import sys


def kernels(path: str) -> list[tuple[str, float]]:
    """(name, nanoseconds) of every profiled kernel, in launch order."""
    rows = list(csv.reader(open(path)))
    head_at = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head = rows[head_at]
    name = head.index("Kernel Name")
    time = next(i for i, h in enumerate(head) if h.startswith("gpu__time_duration"))
    data = [r for r in rows[head_at + 1 :] if len(r) == len(head) and r[0].isdigit()]
    return [(r[name], float(r[time].replace(",", ""))) for r in data]


def step_length(names: list[str], steps: int) -> int:
    """The fewest kernels whose run repeats ``steps`` times at the end of the list."""
    for p in range(1, len(names) // steps + 1):
        if all(names[-p * (i + 1) : len(names) - p * i] == names[-p:] for i in range(steps)):
            return p
    raise SystemExit(f"the last {steps} steps do not repeat: profile more steps")


def short(name: str) -> str:
    # Our kernels' names: custom_kernel_<name>_<digest of the source>_<template constants>.
    custom = re.search(r"custom_kernel_([a-z_]+?)(?:_[0-9a-f]{8})?_(bfloat16|float16|float32|float)", name)
    return custom.group(1) if custom else re.sub(r"^void ", "", name).split("<")[0].split("(")[0][-48:]


def main() -> None:
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    timed = kernels(sys.argv[1])
    per = step_length([n for n, _ in timed], steps)
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for n, t in timed[-per * steps :]:
        total[short(n)][0] += 1
        total[short(n)][1] += t
    busy = sum(t for _, t in total.values()) / steps
    print(f"{per} kernels a step, {busy / 1e3:.1f} us busy a step (each kernel's own time, {steps} steps)")
    for n, (count, t) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:48s} {count / steps:5.0f} a step  {t / steps / 1e3:8.1f} us a step  {t / count / 1e3:7.2f} us each")


if __name__ == "__main__":
    main()
