"""``python -m engine.cli.bench_switches --shape qwen3-4b --rounds 4 --variant "NAME=VALUE ..."``:
decode speed with and without environment switches, in interleaved rounds.

A kernel switch (``MLX_DESK_*``, or MLX's own settings) is read once per process and its
kernels are built for it, so each variant needs a process of its own. On a shared GPU machine
one process's decode can differ from the next's by half within the hour (docs/qmv.md, "Memory
waits": the same default gave 214.6 and 322.6 tok/s), far more than most switches move it, so
variants timed one after another decide nothing. Here every round runs every variant once,
each as ``python -m engine bench ... --json``, in an order that turns by one each round (no
variant always runs first, into a machine idle since the last round), and the verdict is
paired: in how many
rounds a variant beat the default run in the same round, and the median of its ratios to it.

The default is the environment as given, less every variable a variant sets (so it is the
build's default, whatever the shell had set). A variant whose process fails or runs past
``--timeout`` is reported with its last error line and left out of that round's ratios; the
others go on. ``--json`` prints every figure as one object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from engine.cli.bench_shapes import SHAPES

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SpecError(ValueError):
    """A ``--variant`` that is not whitespace-separated NAME=VALUE settings."""


def parse_variant(spec: str) -> dict[str, str]:
    """``"A=1 B=2"`` -> {"A": "1", "B": "2"}."""
    settings: dict[str, str] = {}
    for item in spec.split():
        name, sep, value = item.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise SpecError(f"--variant takes NAME=VALUE settings separated by spaces, not {item!r}")
        settings[name] = value
    if not settings:
        raise SpecError("--variant needs at least one NAME=VALUE setting")
    return settings


def label(settings: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def environments(variants: list[dict[str, str]], base: dict[str, str]) -> list[dict[str, str]]:
    """The default's environment (``base`` less every name a variant sets), then each
    variant's (the default's plus its settings)."""
    names = {name for settings in variants for name in settings}
    default = {k: v for k, v in base.items() if k not in names}
    return [default] + [{**default, **settings} for settings in variants]


def order(count: int, round_index: int) -> list[int]:
    """The variants' order in a round: 0..count-1 turned by one a round."""
    return [(i + round_index) % count for i in range(count)]


def _bench_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "engine", "bench", "--shape", args.shape, "--bits", str(args.bits)]
    command += ["-p", str(args.prompt_tokens), "-g", str(args.generation_tokens), "--repeat", str(args.repeat)]
    return command + ["--json"]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


def why_failed(output: str) -> str:
    """The line of a failed process's output that says why: its last error line, else its last."""
    lines = _lines(output)
    errors = [line for line in lines if re.search(r"error", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


def run_one(command: list[str], env: dict[str, str], timeout: float) -> tuple[float | None, str]:
    """Decode tok/s (the bench's best of its repeats), or None and why."""
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"ran past {timeout:.0f} s"
    if proc.returncode != 0:
        return None, why_failed(proc.stderr + "\n" + proc.stdout)
    try:
        return float(json.loads(_lines(proc.stdout)[-1])["engine"]["generation_tps"]), ""
    except (ValueError, KeyError, TypeError, IndexError):
        return None, "no figures in the bench's output: " + why_failed(proc.stdout)


def summary(runs: list[list[float | None]]) -> list[dict[str, Any]]:
    """Per variant (0 is the default): its runs, median, best, and against the default run of
    the same round: the rounds it won and the median of its ratios."""
    out = []
    for i, mine in enumerate(runs):
        done = [t for t in mine if t is not None]
        pairs = [(t, d) for t, d in zip(mine, runs[0]) if t is not None and d is not None]
        row: dict[str, Any] = {
            "runs": mine,
            "median": statistics.median(done) if done else None,
            "best": max(done) if done else None,
        }
        if i:
            row["rounds_faster"] = sum(t > d for t, d in pairs)
            row["rounds_compared"] = len(pairs)
            row["median_ratio"] = statistics.median(t / d for t, d in pairs) if pairs else None
        out.append(row)
    return out


def _cell(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'failed':>9}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_switches", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("-p", "--prompt-tokens", type=int, default=512)
    p.add_argument("-g", "--generation-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="the bench's own runs a process (it keeps the best)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help='settings of one variant, e.g. "MLX_DESK_QMV_COLUMNS=4 MLX_DESK_QMV_ONE_OP_CODES=0" (repeatable)',
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a process may take")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    try:
        variants = [parse_variant(spec) for spec in args.variant]
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not variants or args.rounds < 1:
        print("error: give at least one --variant and --rounds of 1 or more", file=sys.stderr)
        return 2
    names = ["default"] + [label(v) for v in variants]
    envs = environments(variants, dict(os.environ))
    command = _bench_command(args)
    runs: list[list[float | None]] = [[None] * args.rounds for _ in names]
    for r in range(args.rounds):
        for i in order(len(names), r):
            start = time.perf_counter()
            tps, why = run_one(command, envs[i], args.timeout)
            runs[i][r] = tps
            took = time.perf_counter() - start
            figure = f"{tps:.1f} tok/s" if tps is not None else f"failed: {why}"
            print(f"round {r + 1}  {names[i]:<40} {figure}  ({took:.0f} s)", flush=True)
    rows = summary(runs)
    print()
    print(
        f"{'variant':<40}"
        + "".join(f"{'round ' + str(r + 1):>9}" for r in range(args.rounds))
        + "   median  faster  ratio"
    )
    for name, row in zip(names, rows):
        line = f"{name:<40}" + "".join(_cell(t) for t in row["runs"]) + _cell(row["median"])
        if "rounds_faster" in row:
            ratio = f"{row['median_ratio']:.3f}x" if row["median_ratio"] is not None else "-"
            line += f"  {row['rounds_faster']}/{row['rounds_compared']:<4} {ratio}"
        print(line)
    if args.json:
        out = {"shape": args.shape, "command": command, "variants": dict(zip(names, rows))}
        print(json.dumps(out))
    return 0 if all(row["median"] is not None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
