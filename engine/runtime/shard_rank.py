"""One rank of a sharded model: ``python -m engine node`` runs this.

The launcher (shard_group.py) starts one such process per host with MLX's own
environment (``MLX_RANK``, ``MLX_HOSTFILE`` for ring; the variables mlx.launch sets for
JACCL and NCCL). In order, a rank:

1. joins the group (``mx.distributed.init``) and exchanges versions: every rank must run
   the same engine and MLX versions, or all refuse at once naming the odd one out;
2. shares its room (memory budget); rank 0 reads the checkpoint's headers, makes the
   per-rank plan (shard_plan.py) and hands it to all, or refuses the split for all
   before any weight is read;
3. loads its share through the ordinary ModelHost (shard_load.use_shard);
4. serves commands: rank 0 reads them as JSON lines on stdin and hands each to every
   rank (the same requests in the same order, so caches and prefix reuse stay in step);
   every rank runs the same decode loop on the same logits, and rank 0 writes the events
   as JSON lines on stdout. A ``stop`` line raises the stop flag that every rank sees at
   the next step. Stdin closing ends the rank (and, through the "quit" it hands on, the
   others).

Every rank writes a heartbeat line on stdout every ``HEARTBEAT_S`` seconds from its own
thread, which the launcher uses to tell a stopped rank from a busy one. Protocol lines
go to the original stdout only; anything else a library prints goes to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HEARTBEAT_S = 0.5
PROTOCOL_VERSION = 1
# The launcher's process id, given to the ranks it starts on this machine (shard_group.py).
LAUNCHER_ENV = "MLX_DESK_LAUNCHER_PID"


class Channel:
    """JSON lines on the original stdout, one writer at a time."""

    def __init__(self) -> None:
        self._fd = os.dup(1)
        os.dup2(2, 1)  # stray prints (libraries) go to stderr, never into the protocol
        sys.stdout = sys.stderr
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        with self._lock:
            os.write(self._fd, data)


def versions() -> dict[str, str]:
    import mlx.core as mx

    try:
        from importlib.metadata import version

        engine = version("mlx-desk")
    except Exception:  # noqa: BLE001 - running from a source tree without metadata
        engine = "source"
    return {"engine": engine, "mlx": mx.__version__, "protocol": str(PROTOCOL_VERSION)}


def probe() -> dict[str, Any]:
    """What another machine needs to know of this one before sharding with it: versions
    (they must match), memory (its room) and which backends it can join."""
    import mlx.core as mx

    from engine.runtime.memory import default_budget, total_memory

    return {
        **versions(),
        "total_memory": total_memory(),
        "room": default_budget()[0],
        "backends": [b for b in ("ring", "jaccl", "nccl") if mx.distributed.is_available(backend=b)],
    }


def check_versions(seen: list[dict[str, str]], hosts: list[str]) -> str | None:
    """One line naming the first rank whose versions differ from rank 0's, or None."""
    for rank, v in enumerate(seen[1:], start=1):
        if v != seen[0]:
            theirs = ", ".join(f"{k} {v.get(k)}" for k in sorted(seen[0]))
            ours = ", ".join(f"{k} {seen[0].get(k)}" for k in sorted(seen[0]))
            return (
                f"rank {rank} on {hosts[rank]} runs {theirs} but rank 0 runs {ours}: "
                "install the same MLX Desk and MLX on every machine"
            )
    return None


# ---- collectives over the group --------------------------------------------------------------


def broadcast_json(group: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (others pass None)."""
    import mlx.core as mx

    data = json.dumps(obj).encode() if group.rank() == 0 else b""
    n = int(mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=group).item())
    buf = mx.array(list(data), dtype=mx.int32) if data else mx.zeros((n,), dtype=mx.int32)
    out = mx.distributed.all_sum(buf, group=group)
    return json.loads(bytes(out.astype(mx.uint8).tolist()).decode())


def gather_json(group: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    import mlx.core as mx

    data = json.dumps(obj).encode()
    size = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32), group=group)
    longest = int(size.max().item())
    padded = mx.array(list(data) + [0] * (longest - len(data)), dtype=mx.int32).reshape(1, -1)
    rows = mx.distributed.all_gather(padded, group=group).astype(mx.uint8).tolist()
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(rows, size.tolist())]


# ---- the rank ---------------------------------------------------------------------------


@dataclasses.dataclass
class NodeOptions:
    model: str
    mode: str
    hosts: list[str]
    budget: int | None = None
    backend: str = "any"
    dtype: str | None = None
    kv_bits: int | None = None  # each rank's KV cache held quantized
    kv_group_size: int = 64


@dataclasses.dataclass
class _Node:
    """The rank's host and the split of the model it holds now."""

    host: Any
    spec: Any = None


def die_with_launcher() -> None:
    """A rank started on the launcher's machine ends when the launcher does, whatever ends it
    (Linux's parent-death signal), and at once where the launcher is already gone. Asked by
    the rank at its start: asked between the fork and the exec in the launcher, Python code in
    the child (loading libc) once waited forever on a lock another of the launcher's threads
    held at the fork, and the rank never started."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it ended before the signal was asked for
        os._exit(3)


def _heartbeat(channel: Channel, parent: int) -> None:
    while True:
        channel.send({"hb": time.time()})
        if os.getppid() != parent:  # the launcher is gone: so is the reason to run
            os._exit(3)
        time.sleep(HEARTBEAT_S)


def _plan(group: Any, opts: NodeOptions) -> dict[str, Any]:
    """Every rank's share, or the one-line refusal, decided by rank 0 for all."""
    from engine.runtime.memory import default_budget

    room = opts.budget if opts.budget is not None else default_budget()[0]
    rooms = [int(r) for r in gather_json(group, room)]
    plan: dict[str, Any] | None = None
    if group.rank() == 0:
        plan = _decide(opts, rooms)
    return broadcast_json(group, plan)


def _decide(opts: NodeOptions, rooms: list[int]) -> dict[str, Any]:
    from engine.artifacts.config import read_config
    from engine.artifacts.hub import resolve_model_path
    from engine.errors import EngineError
    from engine.models import get_family
    from engine.models.sharding import check_family
    from engine.runtime.shard_plan import checkpoint_sizes, plan_pipeline, plan_tensor

    try:
        path = resolve_model_path(opts.model)
        config = read_config(path)
        check_family(config.model_type, opts.mode)
        args = get_family(config.model_type).ModelArgs.from_dict(config.raw)
        sizes = checkpoint_sizes(path, int(args.num_hidden_layers), bool(getattr(args, "tie_word_embeddings", False)))
        planner = plan_pipeline if opts.mode == "pipeline" else plan_tensor
        return {"shares": [s.to_json() for s in planner(sizes, rooms, opts.hosts)], "hub_layout": sizes.hub_layout}
    except EngineError as e:
        return {"error": str(e)}


def run_node(opts: NodeOptions, leader: Callable[[Channel, Any, NodeOptions], int] | None = None) -> int:
    """The whole life of a rank; returns its exit status. With ``leader``, rank 0 hands
    itself over to it once the group is formed (``serve --hosts``: shard_leader.py)."""
    die_with_launcher()
    channel = Channel()
    threading.Thread(target=_heartbeat, args=(channel, os.getppid()), daemon=True).start()
    import mlx.core as mx

    try:
        # One rank over ring (or MLX's pick) has no peer to connect to: MLX's group of one.
        # NCCL and JACCL form their group even of one (a backend checked on one process).
        alone = len(opts.hosts) == 1 and opts.backend in ("ring", "any")
        group = mx.distributed.init(strict=not alone, backend=opts.backend)
    except RuntimeError as e:  # a backend this MLX build lacks (NCCL without CUDA), or one that failed
        channel.send({"error": _no_backend(opts, str(e))})
        return 1
    if group.size() != len(opts.hosts):
        channel.send({"error": f"the group has {group.size()} ranks but {len(opts.hosts)} hosts were given"})
        return 1
    problem = check_versions(gather_json(group, versions()), opts.hosts)
    if problem is not None:
        channel.send({"error": problem})
        return 1
    if leader is not None and group.rank() == 0:
        return leader(channel, group, opts)
    from engine.runtime.host import ModelHost

    host = _Node(ModelHost())
    if not _load(channel, group, host, opts):
        return 1
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    if group.rank() == 0:
        threading.Thread(target=_read_stdin, args=(commands, host), daemon=True).start()
    while True:
        cmd = broadcast_json(group, commands.get() if group.rank() == 0 else None)
        op = cmd.get("op")
        if op == "quit":
            return 0
        if op == "drop":  # rank 0 let a session go: so does every rank (caches stay in step)
            host.host.drop_session(cmd.get("session", ""))
        elif op in ("restore", "save"):  # each rank its own part of a saved cache
            _cache_command(channel, host, cmd)
        elif op == "load":  # another model on the same machines
            opts = dataclasses.replace(opts, model=cmd["model"], mode=cmd.get("shard") or opts.mode)
            if not _load(channel, group, host, opts):
                return 1
        else:
            _run_command(channel, host.host, host.spec, cmd)


def _no_backend(opts: NodeOptions, why: str) -> str:
    import mlx.core as mx

    rank = os.environ.get("MLX_RANK", "0")
    host = opts.hosts[int(rank)] if rank.isdigit() and int(rank) < len(opts.hosts) else "this machine"
    if opts.backend != "any" and not mx.distributed.is_available(backend=opts.backend):
        have = [b for b in ("ring", "jaccl", "nccl") if mx.distributed.is_available(backend=b)]
        return (
            f"rank {rank} on {host}: this MLX build has no {opts.backend} backend "
            f"(it has {', '.join(have) or 'none'}): pick --backend {' or '.join(have) or 'any'}"
            + (", or install MLX's CUDA build (pip install mlx[cuda])" if opts.backend == "nccl" else "")
        )
    return f"rank {rank} on {host}: could not join the {opts.backend} group: {why}"


def prepare(channel: Channel, group: Any, node: _Node, opts: NodeOptions) -> dict[str, Any] | None:
    """Plan the split with every rank and make this process load its share from now on;
    None after a refusal (sent to the launcher: the plan, the family)."""
    from engine.models.sharding import ShardSpec
    from engine.runtime.shard_load import use_shard

    plan = _plan(group, opts)
    if "error" in plan:
        channel.send({"error": plan["error"]})
        return None
    mine = plan["shares"][group.rank()]
    node.spec = ShardSpec(group, opts.mode, mine["start"], mine["end"], hub_layout=plan.get("hub_layout"))
    use_shard(node.spec)
    return mine


def report_ready(channel: Channel, node: _Node, opts: NodeOptions, mine: dict[str, Any]) -> None:
    """What this rank holds, measured: the launcher's ``ranks``."""
    from engine.models.sharding import held_bytes

    rank = node.spec.rank
    held = held_bytes(node.host.model)
    ready = {"rank": rank, "host": opts.hosts[rank], "weight_bytes": held, "layers": [mine["start"], mine["end"]]}
    channel.send({"ready": ready})


def _load(channel: Channel, group: Any, node: _Node, opts: NodeOptions) -> bool:
    """Plan, then load this rank's share; False after a refusal."""
    from engine.errors import EngineError

    mine = prepare(channel, group, node, opts)
    if mine is None:
        return False
    try:
        node.host.load(
            opts.model,
            budget=opts.budget,
            progress=lambda done, total, _message: channel.send({"progress": [done, total]}),
            kv_bits=opts.kv_bits,
            kv_group_size=opts.kv_group_size,
        )
    except EngineError as e:
        rank = group.rank()
        channel.send({"error": f"rank {rank} on {opts.hosts[rank]}: {e}"})
        return False
    report_ready(channel, node, opts, mine)
    return True


def _cache_command(channel: Channel, node: _Node, cmd: dict[str, Any]) -> None:
    from engine.runtime import shard_cache

    session, path = cmd.get("session", ""), cmd["path"]
    if cmd["op"] == "restore":
        tokens, why = shard_cache.restore(node.host, node.spec, session, path, gather_json)
        if node.spec.rank == 0:
            channel.send({"restored": tokens, "why": why})
    else:
        written = shard_cache.save(node.host, node.spec, session, path)
        if node.spec.rank == 0:
            channel.send({"saved": written})


def _read_stdin(commands: queue.Queue, host: _Node) -> None:
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
        except ValueError:
            continue
        if cmd.get("op") == "stop":
            host.spec.requested.set()
        else:
            commands.put(cmd)
    host.spec.requested.set()  # the launcher went away: end what runs, then quit
    commands.put({"op": "quit"})


def _run_command(channel: Channel, host: Any, spec: Any, cmd: dict[str, Any]) -> None:
    from engine.api import TokenEvent
    from engine.errors import EngineError

    speak = spec.rank == 0
    spec.begin()
    if speak and not cmd.get("keep_stop"):
        spec.requested.clear()

    def on_event(event: Any) -> None:
        if speak and isinstance(event, TokenEvent):
            channel.send({"token": event.text, "channel": event.channel, "ids": event.token_ids})

    try:
        params = _params(cmd.get("params") or {})
        if cmd.get("op") == "generate" and cmd.get("messages"):
            result = host.generate(
                cmd.get("session", ""),
                cmd["messages"],
                params,
                on_event,
                spec.agreed,
                tools=cmd.get("tools"),
                add_generation_prompt=cmd.get("add_generation_prompt", True),
                **(cmd.get("template_kwargs") or {}),
            )
        else:
            ids = cmd.get("ids") or host.encode_prompt(cmd.get("prompt") or "")
            result = host.generate_ids(ids, params, on_event, spec.agreed, session_id=cmd.get("session", ""))
    except EngineError as e:
        if speak:
            channel.send({"failed": str(e)})
        return
    if speak:
        channel.send({"result": _result_json(result)})


def _params(d: dict[str, Any]) -> Any:
    from engine.api import GenerationParams, SamplingParams

    d = dict(d)
    sampling = SamplingParams(**(d.pop("sampling", None) or {}))
    return GenerationParams(sampling=sampling, **d)


def params_json(params: Any) -> dict[str, Any]:
    return dataclasses.asdict(params)


def _result_json(result: Any) -> dict[str, Any]:
    s = result.stats
    return {
        "text": result.text,
        "reasoning": result.reasoning,
        "token_ids": result.token_ids,
        "token_logprobs": result.token_logprobs,
        "finish_reason": result.finish_reason,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "generated_tokens": s.generated_tokens,
        "prompt_tps": s.prompt_tps,
        "generation_tps": s.generation_tps,
        "peak_memory_bytes": s.peak_memory_bytes,
    }
