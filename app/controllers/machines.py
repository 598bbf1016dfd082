"""Model → Machines…: the machines a model may be split across, and what each one is.

The list lives in ``machines.json`` in the data folder (``{"machines": [{"host": ...}]}``).
Checking a machine runs the engine's probe there (``python -m engine node --probe``:
this machine's own interpreter for 127.0.0.1/localhost, ``ssh`` with no password prompt
otherwise) and reads its engine and MLX versions, memory and the backends it can join
(JACCL means a Thunderbolt RDMA link is possible). A machine that cannot be reached, or
answers with other versions than this one, says so in one line. No widgets here, and no
mlx: the probe runs in another process, off the GUI thread (``check``).

A model too large for this machine may fit across this one and the saved machines:
``plan_for`` asks the engine for its per-rank plan (the one a sharded load makes) over
each machine's free memory as its probe reports it, with this machine as rank 0 and the
saved machines after it in order, and keeps the fewest machines it fits on;
``split_for`` hands that split to a load. ``shard`` (pipeline or tensor) is saved beside
the list.
"""

from __future__ import annotations

import asyncio
import json
import socket
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


THIS_MACHINE = "127.0.0.1"
SHARD_MODES = ("pipeline", "tensor")


@dataclass
class Split:
    """Where a model too large for this machine fits: the hosts in rank order."""

    hosts: list[str]
    shard: str
    needs: list[int]  # the engine's plan: each rank's bytes
    rooms: list[int]


@dataclass
class MachineStatus:
    host: str
    reachable: bool
    detail: str  # one line: versions, memory, links; or why it cannot be used
    info: dict[str, Any] | None = None


class MachinesController:
    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / CONFIG_NAME
        self.shard = "pipeline"
        self.hosts: list[str] = self._read()
        self.statuses: dict[str, MachineStatus] = {}  # as last checked
        self._splits: dict[str, Split] = {}  # model path -> where it fits

    def _read(self) -> list[str]:
        try:
            data = json.loads(self.path.read_text())
            if data.get("shard") in SHARD_MODES:
                self.shard = data["shard"]
            return [str(m["host"]) for m in data.get("machines", []) if m.get("host")]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return []

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        data: dict[str, Any] = {"machines": [{"host": h} for h in self.hosts]}
        if self.shard != "pipeline":
            data["shard"] = self.shard
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path)

    def set_shard(self, mode: str) -> None:
        if mode not in SHARD_MODES:
            raise ValueError(f"Split by {' or '.join(SHARD_MODES)}.")
        self.shard = mode
        self._splits.clear()  # planned for the other way of splitting
        self._write()

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
            self._splits.clear()  # planned with it
            self._write()

    async def check(self, host: str) -> MachineStatus:
        """The machine's status, probed in another process (never blocks the window)."""
        status = await asyncio.get_running_loop().run_in_executor(_PROBES, probe_machine, host)
        self.statuses[host] = status
        return status

    # ---- splitting a model across machines ------------------------------------------

    async def plan_for(self, bridge: Any, path: str) -> Split | None:
        """The fewest machines (this one first, then the saved ones) the engine's plan fits
        ``path`` on, each with its free memory as probed; None when none does."""
        self._splits.pop(path, None)
        if not self.hosts:
            return None
        machines = [THIS_MACHINE, *self.hosts]
        for host in machines:
            if host not in self.statuses:
                await self.check(host)
        usable = [h for h in machines if self.statuses[h].reachable and self.statuses[h].info]
        if THIS_MACHINE not in usable or len(usable) < 2:
            return None
        names = _rank_names(usable)
        rooms = [int((self.statuses[h].info or {}).get("room", 0)) for h in usable]
        for n in range(2, len(usable) + 1):
            plan = await bridge.plan_shards(path, names[:n], rooms[:n], self.shard)
            if plan.fits:
                split = Split(names[:n], self.shard, [r.weight_bytes for r in plan.ranks], rooms[:n])
                self._splits[path] = split
                return split
        return None

    async def plan_all(self, bridge: Any, paths: list[str]) -> None:
        """``plan_for`` each model; one that cannot be planned is left out, not fatal."""
        for path in paths:
            try:
                await self.plan_for(bridge, path)
            except Exception:  # noqa: BLE001 - an unreadable checkpoint keeps its "too big"
                self._splits.pop(path, None)

    def fits_across(self, path: str) -> str | None:
        split = self._splits.get(path)
        return None if split is None else f"✓ fits across {len(split.hosts)} machines ({split.shard})"

    def split_for(self, path: str) -> Split | None:
        """Where ``path`` was last planned to fit across machines (None: on this one)."""
        return self._splits.get(path)


def _rank_names(hosts: list[str]) -> list[str]:
    """This machine's name for the launcher: 127.0.0.1 when every rank is local, else the
    name the other machines reach it by (the launcher refuses to mix the two)."""
    if all(h in LOOPBACK for h in hosts):
        return ["127.0.0.1" if h == "localhost" else h for h in hosts]
    return [socket.gethostname() if h == THIS_MACHINE else h for h in hosts]


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
