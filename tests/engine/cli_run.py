"""Running ``python -m engine generate`` on a folder from a test, and reading its refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def generate(folder: Path) -> subprocess.CompletedProcess:
    """Two tokens after ids 5, 6, 7 from ``folder``, through the command line."""
    return subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--prompt-ids", "5,6,7"]
        + ["--max-tokens", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_failure(proc: subprocess.CompletedProcess) -> str:
    """The refusal: a non-zero exit and one line on stderr, no traceback."""
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr.strip()
    assert err and "\n" not in err and "Traceback" not in err, proc.stderr
    return err
