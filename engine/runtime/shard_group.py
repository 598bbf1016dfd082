"""Starting, watching and ending the ranks of a sharded model (the launcher's side).

``RankGroup`` starts one ``python -m engine node`` per host the way ``mlx.launch`` does:
the same environment MLX's distributed layer reads (``MLX_RANK``; for ring a hostfile of
``ip:port`` per rank in ``MLX_HOSTFILE``; for NCCL ``NCCL_HOST_IP``/``NCCL_PORT``/
``MLX_WORLD_SIZE``; for JACCL the coordinator and the RDMA device matrix of an mlx
hostfile), as local processes when every host is this machine (127.0.0.1/localhost),
through ``ssh`` otherwise. It talks to rank 0 in JSON lines (shard_rank.py) and watches
every rank: a rank whose process ends, or whose heartbeat stops for ``SILENT_S``
seconds, fails the group at once with one line naming its rank and host, and every
other rank is ended by its process id. Nothing is left running once ``close`` returns.
Mlx-free: the app may hold one.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.runtime.shard_rank import LAUNCHER_ENV

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SILENT_S = 4.0  # a rank silent this long (no heartbeat) has stopped answering
STARTUP_SILENT_S = 60.0  # the same before it has loaded
RING_PORT = 32323  # mlx.launch's default first port for remote ranks
# Every NCCL rank's environment: NVLink multicast (NVLS) stays off. Where it is on but the
# fabric cannot grant it, NCCL's and NVSHMEM's setup fails or hangs; off, NCCL uses the
# plain NVLink/PCIe rings, which is what a two-GPU split measures.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankLost(EngineError):
    """A rank died or stopped answering; the message names it and its host."""


@dataclass
class _Rank:
    rank: int
    host: str
    proc: subprocess.Popen
    beat: float = field(default_factory=time.monotonic)
    ready: dict[str, Any] | None = None
    done: bool = False  # exited as asked
    errors: deque = field(default_factory=lambda: deque(maxlen=20))
    reader: threading.Thread | None = None
    err_reader: threading.Thread | None = None


def parse_hosts(text: str) -> tuple[list[str], dict[str, Any] | None]:
    """``H1,H2,...`` or an mlx hostfile (``*.json``: hosts with ssh names, ips, rdma)."""
    if text.endswith(".json") and Path(text).is_file():
        data = json.loads(Path(text).read_text())
        hosts = data["hosts"] if isinstance(data, dict) else data
        return [h["ssh"] for h in hosts], data if isinstance(data, dict) else {"hosts": data}
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise EngineError("--hosts needs one host or more, comma-separated (e.g. 127.0.0.1,127.0.0.1)")
    return hosts, None  # one host: a one-rank group (a backend checked against one process)


# Ports for local ranks: below the ephemeral range (Linux's starts at 32768, macOS's at
# 49152). A port the system hands out for bind(0) is one its outgoing connections draw from
# too, so in the second between choosing it and a rank binding it, any connection made on the
# machine could take it and the rank would fail to start.
LOCAL_PORTS = range(20000, 32000)


def _free_ports(n: int) -> list[int]:
    """``n`` different ports on 127.0.0.1 that nothing listens on now, from ``LOCAL_PORTS``:
    each is bound while the others are chosen, so two ranks never get the same one."""
    held: list[socket.socket] = []
    try:
        for port in random.sample(LOCAL_PORTS, len(LOCAL_PORTS)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [h.getsockname()[1] for h in held]
        raise EngineError(f"no {n} free local ports between {LOCAL_PORTS.start} and {LOCAL_PORTS.stop - 1}")
    finally:
        for h in held:
            h.close()


def _ip(host: str) -> str:
    if host in LOOPBACK:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise EngineError(f"cannot resolve host {host!r}: give its IP address or fix its name") from None


class RankGroup:
    def __init__(
        self,
        hosts: str | list[str],
        node_args: list[str],
        *,
        backend: str = "any",
        python: str | None = None,
        echo: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.hosts, self.hostfile = parse_hosts(hosts) if isinstance(hosts, str) else (list(hosts), None)
        self.local = all(h in LOOPBACK for h in self.hosts)
        if not self.local and any(h in LOOPBACK for h in self.hosts):
            raise EngineError("mixing 127.0.0.1 with other machines: name this machine by its address too")
        self.backend = backend
        self.python = python or sys.executable
        self.node_args = node_args
        self._events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self._ranks: list[_Rank] = []
        self._files: list[str] = []
        self._closing = False
        self.echo = echo  # rank 0's messages (a server's address) to this process's stderr
        self.extra_env = dict(env or {})

    # ---- starting --------------------------------------------------------------------

    def _env(self) -> tuple[dict[str, str], dict[str, str]]:
        """(variables, files to write and name in a variable) every rank gets."""
        listed = [(h.get("ips") or [None])[0] for h in (self.hostfile or {}).get("hosts") or []]
        # A hostfile's addresses (a Thunderbolt bridge's, say) before what the names resolve to.
        ips = [ip or _ip(h) for h, ip in zip(self.hosts, listed or [None] * len(self.hosts))]
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1", **self.extra_env}
        files: dict[str, str] = {}
        if self.backend in ("ring", "any") and len(ips) > 1:  # one rank: a group of one, no ring
            ports = _free_ports(len(ips)) if self.local else [RING_PORT + r for r in range(len(ips))]
            files["MLX_HOSTFILE"] = json.dumps([[f"{ip}:{port}"] for ip, port in zip(ips, ports)])
        if self.backend == "nccl":
            env.update(NCCL_HOST_IP=ips[0], NCCL_PORT=str(_free_ports(1)[0] if self.local else 12345))
            env["MLX_WORLD_SIZE"] = str(len(ips))
            env.update(NCCL_ENV)
        if self.backend == "jaccl":
            hosts = (self.hostfile or {}).get("hosts") or []
            if not hosts or not all(h.get("rdma") for h in hosts):
                raise EngineError(
                    "--backend jaccl needs an mlx hostfile with each host's rdma devices (--hosts FILE.json)"
                )
            env["MLX_JACCL_COORDINATOR"] = f"{(hosts[0].get('ips') or [ips[0]])[0]}:{RING_PORT}"
            files["MLX_IBV_DEVICES"] = json.dumps([h["rdma"] for h in hosts])
        for extra in (self.hostfile or {}).get("envs") or []:
            key, _, value = str(extra).partition("=")
            env[key] = value
        return env, files

    def start(self) -> None:
        env, files = self._env()
        command = [self.python, "-m", "engine", "node", *self.node_args, "--hosts", ",".join(self.hosts)]
        command += ["--backend", self.backend]
        for rank, host in enumerate(self.hosts):
            proc = self._spawn(rank, host, env, files, command)
            r = _Rank(rank, host, proc)
            self._ranks.append(r)
            r.reader = threading.Thread(target=self._read_out, args=(r,), daemon=True)
            r.reader.start()
            r.err_reader = threading.Thread(target=self._read_err, args=(r,), daemon=True)
            r.err_reader.start()

    def _spawn(self, rank: int, host: str, env: dict[str, str], files: dict[str, str], command: list[str]):
        if self.local:
            # The rank asks to end with this process itself (shard_rank.die_with_launcher):
            # asked here, between the fork and the exec (a ``preexec_fn``), Python code in the
            # child could wait forever on a lock another thread of this one held at the fork.
            full = dict(os.environ, **env, MLX_RANK=str(rank), **{LAUNCHER_ENV: str(os.getpid())})
            if self.backend == "nccl":
                full["CUDA_VISIBLE_DEVICES"] = str(rank)
            for name, content in files.items():
                fd, path = tempfile.mkstemp(prefix="mlx-desk-rank-", suffix=".json")
                os.write(fd, content.encode())
                os.close(fd)
                self._files.append(path)
                full[name] = path
            return subprocess.Popen(
                command,
                env=full,
                cwd=os.getcwd(),
                stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        return subprocess.Popen(
            ["ssh", "-o", "BatchMode=yes", "-o", "LogLevel=QUIET", host, remote_script(rank, env, files, command)],
            stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def _read_out(self, r: _Rank) -> None:
        for line in r.proc.stdout:  # type: ignore[union-attr]
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            r.beat = time.monotonic()
            if "hb" not in obj:
                self._events.put((r.rank, obj))

    def _read_err(self, r: _Rank) -> None:
        for line in r.proc.stderr:  # type: ignore[union-attr]
            text = line.decode(errors="replace").rstrip()
            if text:
                r.errors.append(text)
                if self.echo and r.rank == 0:
                    print(text, file=sys.stderr, flush=True)

    # ---- watching --------------------------------------------------------------------

    def _check(self) -> None:
        """Raise RankLost naming the rank that ended or went silent first."""
        ended = [r for r in self._ranks if r.proc.poll() is not None and not r.done]
        if ended:
            time.sleep(0.3)  # a rank's peers fail right after it: let them show how they ended
            ended = [r for r in self._ranks if r.proc.poll() is not None and not r.done]
            for r in ended:  # their last words (a refusal) come first
                if r.reader is not None:
                    r.reader.join(timeout=1.0)
            if not self._events.empty():
                return
            # The culprit: killed by a signal, else not merely a peer of a lost rank.
            r = min(ended, key=lambda r: (r.proc.returncode >= 0, _lost_a_peer(r), r.rank))
            raise RankLost(f"rank {r.rank} on {r.host} stopped answering (it exited{_why(r.proc.returncode, r)})")
        now = time.monotonic()
        for r in self._ranks:
            # Loading may keep a rank busy in calls that hold Python's lock (joining the
            # group, reading files): a longer leash until it has reported ready.
            limit = SILENT_S if r.ready is not None or r.done else STARTUP_SILENT_S
            if now - r.beat > limit:
                raise RankLost(f"rank {r.rank} on {r.host} stopped answering (silent for {now - r.beat:.0f} s)")

    def _next(self, timeout: float = 0.1) -> tuple[int, dict[str, Any]] | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            self._check()
            return None

    def wait_ready(self, on_progress: Any = None) -> list[dict[str, Any]]:
        """Each rank's ``{rank, host, weight_bytes, layers}`` once all have loaded; a refusal
        (versions, the memory plan, a family that does not shard) raises EngineError.
        ``on_progress(rank, done, total)`` follows each rank's load."""
        ready: dict[int, dict[str, Any]] = {}
        try:
            while len(ready) < len(self._ranks):
                item = self._next()
                if item is None:
                    continue
                rank, obj = item
                if "error" in obj:
                    raise EngineError(obj["error"])
                if "progress" in obj and on_progress is not None:
                    on_progress(rank, *obj["progress"])
                if "ready" in obj:
                    ready[rank] = obj["ready"]
                    self._ranks[rank].ready = obj["ready"]
        except BaseException:
            self.close()
            raise
        return [ready[r] for r in sorted(ready)]

    def watch(self) -> None:
        """Return never: raise RankLost when a rank is lost (and end the rest first)."""
        try:
            while True:
                item = self._next(timeout=0.5)
                if item is not None and "error" in item[1]:
                    raise EngineError(item[1]["error"])
        except RankLost:
            self.close(grace=0.0)
            raise

    def load(self, model: str, shard: str) -> list[dict[str, Any]]:
        """Another model (or split) on the same ranks; each rank's ready report."""
        for r in self._ranks:
            r.ready = None  # loading again: the longer leash
        self.send({"op": "load", "model": model, "shard": shard})
        return self.wait_ready()

    def send(self, cmd: dict[str, Any]) -> None:
        stdin = self._ranks[0].proc.stdin
        try:
            stdin.write((json.dumps(cmd) + "\n").encode())  # type: ignore[union-attr]
            stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            self._check()
            raise RankLost(f"rank 0 on {self.hosts[0]} stopped answering") from None

    def expect(self, key: str) -> dict[str, Any]:
        """Rank 0's next message carrying ``key`` (an answer to a command without a stream)."""
        try:
            while True:
                item = self._next()
                if item is not None and key in item[1]:
                    return item[1]
        except RankLost:
            self.close(grace=0.0)
            raise

    def stop(self) -> None:
        """Stop the reply in progress (every rank ends it at the same step)."""
        self.send({"op": "stop"})

    def run(self, cmd: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Send a command and yield rank 0's events until its result (``{"result": ...}``,
        the last) or failure (EngineError). A lost rank ends everything (RankLost)."""
        self.send(cmd)
        try:
            while True:
                item = self._next()
                if item is None:
                    continue
                _, obj = item
                if "failed" in obj:
                    raise EngineError(obj["failed"])
                yield obj
                if "result" in obj:
                    return
        except RankLost:
            self.close(grace=0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    # ---- ending ----------------------------------------------------------------------

    def close(self, grace: float = 2.0) -> None:
        """Ask the ranks to quit; end by pid whatever still runs after ``grace`` seconds."""
        if self._closing:
            return
        self._closing = True
        for r in self._ranks:
            r.done = True
        if self._ranks and self._ranks[0].proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self._ranks[0].proc.stdin.close()  # type: ignore[union-attr]
            except (RankLost, OSError, ValueError):
                pass
        deadline = time.monotonic() + grace
        for r in self._ranks:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in self._ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        for r in self._ranks:  # the pipes go with the processes
            for t in (r.reader, r.err_reader):
                if t is not None:
                    t.join(timeout=1.0)
            for pipe in (r.proc.stdin, r.proc.stdout, r.proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass


def remote_script(rank: int, env: dict[str, str], files: dict[str, str], command: list[str]) -> str:
    """What ssh runs on a remote host for one rank (as mlx.launch does): this folder when it
    exists there, MLX's variables, each file written to a temporary file named in its
    variable, then the rank itself in place of the shell (so ending ssh ends the rank)."""
    script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; "
    for key, value in {**env, "MLX_RANK": str(rank)}.items():
        script += f"export {key}={shlex.quote(value)}; "
    for name, content in files.items():
        script += f"f=$(mktemp); echo {shlex.quote(content)} > $f; export {name}=$f; "
    return script + "exec " + shlex.join(command)


def _lost_a_peer(r: _Rank) -> bool:
    """Whether the rank ended because another one went away (MLX's ring says so)."""
    return any("peer" in line or "onnection" in line for line in list(r.errors)[-5:])


def _why(code: int, r: _Rank) -> str:
    if code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            return f", signal {-code}"
    last = r.errors[-1] if r.errors else ""
    return f" with status {code}" + (f": {last[:200]}" if last else "")
