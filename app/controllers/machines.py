"""Model → Machines…: the machines a model may be split across, and what each one is.

The list lives in ``machines.json`` in the data folder (``{"machines": [{"host": ...}]}``).
Checking a machine runs the engine's probe there (``python -m engine node --probe``:
this machine's own interpreter for 127.0.0.1/localhost, ``ssh`` with no password prompt
otherwise) and reads its engine and MLX versions, memory and the backends it can join
(JACCL means a Thunderbolt RDMA link is possible). A machine that cannot be reached, or
answers with other versions than this one, says so in one line. No widgets here, and no
mlx: the probe runs in another process, off the GUI thread (``check``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAME = "machines.json"
LOOPBACK = ("127.0.0.1", "localhost")
PROBE_TIMEOUT_S = 30.0
# Probes wait on other processes: plain threads of their own (not the loop's default
# executor, whose Qt threads the window would have to wind down).
_PROBES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="machine-probe")


@dataclass
class MachineStatus:
    host: str
    reachable: bool
    detail: str  # one line: versions, memory, links; or why it cannot be used
    info: dict[str, Any] | None = None


class MachinesController:
    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / CONFIG_NAME
        self.hosts: list[str] = self._read()

    def _read(self) -> list[str]:
        try:
            data = json.loads(self.path.read_text())
            return [str(m["host"]) for m in data.get("machines", []) if m.get("host")]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return []

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"machines": [{"host": h} for h in self.hosts]}, indent=2))
        tmp.replace(self.path)

    def add(self, host: str) -> None:
        host = host.strip()
        if not host or any(c.isspace() for c in host) or host.startswith("-"):
            raise ValueError("Give a host name or address, like studio-2.local or 10.0.0.2.")
        if host in self.hosts:
            raise ValueError(f"{host} is already in the list.")
        self.hosts.append(host)
        self._write()

    def remove(self, host: str) -> None:
        if host in self.hosts:
            self.hosts.remove(host)
            self._write()

    async def check(self, host: str) -> MachineStatus:
        """The machine's status, probed in another process (never blocks the window)."""
        return await asyncio.get_running_loop().run_in_executor(_PROBES, probe_machine, host)


def probe_command(host: str) -> list[str]:
    command = [sys.executable, "-m", "engine", "node", "--probe"]
    if host in LOOPBACK:
        return command
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, " ".join(command)]


def probe_machine(host: str, local: dict[str, Any] | None = None) -> MachineStatus:
    try:
        proc = subprocess.run(probe_command(host), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return MachineStatus(host, False, f"not reachable ({type(e).__name__})")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        return MachineStatus(host, False, f"not reachable: {last[:200]}")
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return MachineStatus(host, False, "answered, but not as MLX Desk's engine does: is MLX Desk installed there?")
    return MachineStatus(host, True, describe(info), info)


def describe(info: dict[str, Any]) -> str:
    links = "Thunderbolt RDMA (JACCL)" if "jaccl" in info.get("backends", []) else "ring over the network"
    return (
        f"MLX {info.get('mlx')}, engine {info.get('engine')}, "
        f"{info.get('room', 0) / 1e9:.1f} GB free of {info.get('total_memory', 0) / 1e9:.1f} GB, {links}"
    )
