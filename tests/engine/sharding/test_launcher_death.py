"""A rank started on the launcher's machine ends with the launcher (shard_rank.die_with_launcher),
asked by the rank at its own start: asked between fork and exec in the launcher (as it once
was), the child could wait forever on a lock another launcher thread held at the fork, and
the rank never started (the app's sharded load then hung until its caller gave up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.runtime.shard_rank import LAUNCHER_ENV
from tests.engine.sharding.test_faults import gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
ROOT = Path(__file__).resolve().parents[3]
RANK = "from engine.runtime.shard_rank import die_with_launcher; die_with_launcher(); print('running', flush=True)"


def test_a_rank_whose_launcher_is_gone_at_its_start_ends_at_once():
    env = dict(os.environ, **{LAUNCHER_ENV: "1"})  # not its parent: the launcher ended first
    run = subprocess.run([sys.executable, "-c", RANK], env=env, cwd=ROOT, capture_output=True, timeout=60)
    assert run.returncode == 3
    assert b"running" not in run.stdout


def test_a_rank_ends_when_its_launcher_is_killed():
    # A launcher with a second thread, as the engine's is, that starts a rank and waits.
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys, threading, time
        threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
        env = dict(os.environ, {LAUNCHER_ENV}=str(os.getpid()))
        rank = subprocess.Popen([sys.executable, "-c", {RANK + "; import time; time.sleep(60)"!r}], env=env,
                                stdout=subprocess.PIPE)
        rank.stdout.readline()
        print(rank.pid, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        rank = int(proc.stdout.readline())
        assert not gone(rank)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not gone(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(rank)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
