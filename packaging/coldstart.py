"""Measure the time from process start to the first painted window.

    python packaging/coldstart.py [--runs N] -- COMMAND [ARGS...]
    python packaging/coldstart.py -- dist/mlx-desk/mlx-desk
    python packaging/coldstart.py -- python -m app.main

Needs nothing from the app: Qt's own widget-painting log says when the main
window is first painted and flushed, stamped with the boot clock, which this
script also reads just before it starts the process. It runs Qt offscreen
unless QT_QPA_PLATFORM says otherwise, with a throwaway --data-dir, and stops
the app once the window is up. Prints each run and the median, in seconds, with
the CPU time the process had used by then (wall time on a loaded machine is
mostly waiting for a core).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# Qt logs this line when it paints and flushes a top-level window for the first time.
PAINTED = re.compile(r"^\s*(\d+\.\d+) .*Painting and flushing dirty top level")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process (Linux /proc), or nan elsewhere."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def one_run(command: list[str], timeout: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds) from launch to the first painted window."""
    env = dict(os.environ)
    env.setdefault("QT_QPA_PLATFORM", "offscreen")
    env["QT_LOGGING_RULES"] = "qt.widgets.painting=true"
    env["QT_MESSAGE_PATTERN"] = "%{time boot} %{message}"
    with tempfile.TemporaryDirectory() as data:
        start = time.clock_gettime(time.CLOCK_BOOTTIME)
        proc = subprocess.Popen(
            [*command, "--data-dir", data],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        try:
            deadline = time.monotonic() + timeout
            assert proc.stderr is not None
            for line in proc.stderr:
                match = PAINTED.match(line)
                if match:
                    return float(match.group(1)) - start, cpu_seconds(proc.pid)
                if time.monotonic() > deadline:
                    break
            raise SystemExit(f"no window was painted within {timeout:.0f} s (exit code {proc.poll()})")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the app's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    times, cpus = [], []
    for i in range(args.runs):
        t, cpu = one_run(command, args.timeout)
        times.append(t)
        cpus.append(cpu)
        print(f"run {i + 1}: {t:.3f} s  (CPU {cpu:.2f} s)")
    print(
        f"first {times[0]:.3f} s, median {statistics.median(times):.3f} s over {len(times)} runs;"
        f" median CPU {statistics.median(cpus):.2f} s (what a busy machine cannot inflate)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
