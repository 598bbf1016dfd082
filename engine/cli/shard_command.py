"""``generate --hosts H1,H2 --shard pipeline|tensor`` and ``node``: sharded inference.

``generate`` with ``--hosts`` starts one rank per host (engine.runtime.shard_group),
waits for every rank to load its share, hands rank 0 the request and prints what rank 0
streams back, as the single-machine ``generate`` does; ``--json`` adds ``ranks``. A
lost rank ends the reply with one line naming it; the text so far stays printed. Ctrl-C
stops the reply on every rank, then ends them. ``node`` is a rank itself (what the
launcher starts on each host; see docs/sharding.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from engine.errors import EngineError

MODES = ("pipeline", "tensor")
API_KEY_VARIABLE = "MLX_DESK_SERVE_API_KEY"  # handed to rank 0 in its environment, never on a command line
BACKENDS = ("ring", "jaccl", "nccl", "any")
# What a rank cannot do (yet): each refused in one line before any rank starts.
_REFUSED = (
    ("adapter", "--adapter"),
    ("draft_model", "--draft-model"),
    ("ngram", "--ngram"),
    ("mtp", "--mtp"),
    ("image", "--image"),
    ("audio", "--audio"),
    ("video", "--video"),
)


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hosts",
        metavar="H1,H2[,...]|FILE.json",
        help="run the model across these machines (one rank each; 127.0.0.1 repeated: local processes), "
        "or an mlx hostfile",
    )
    p.add_argument("--shard", choices=MODES, help="how to split the model across --hosts (default pipeline)")
    p.add_argument("--backend", choices=BACKENDS, default="any", help="MLX distributed backend (default: MLX's pick)")


def _budget(text: str) -> int:
    from engine.runtime.memory import parse_budget

    try:
        return parse_budget(text)
    except EngineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_node(sub: Any) -> None:
    p = sub.add_parser("node", help="one rank of a sharded model (started on each machine by --hosts)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="print this machine's engine and MLX versions, memory and links as JSON, and exit",
    )
    p.add_argument("--model")
    p.add_argument("--shard", choices=MODES, default="pipeline")
    p.add_argument("--hosts", help="every rank's host, in rank order")
    p.add_argument("--backend", choices=BACKENDS, default="any")
    p.add_argument("--memory-budget", type=_budget, help="this machine's room for its share")
    p.add_argument("--serve", metavar="HOST:PORT", help="rank 0 serves the HTTP API there (serve --hosts)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], help="hold each rank's KV cache quantized")
    p.add_argument("--kv-group-size", type=int, default=64)


def cmd_node(args: argparse.Namespace) -> int:
    from engine.runtime.shard_rank import NodeOptions, probe, run_node

    if args.probe:
        print(json.dumps(probe()))
        return 0
    if not args.model or not args.hosts:
        raise EngineError("node needs --model PATH and --hosts H1,H2[,...] (or --probe)")
    hosts = [h for h in args.hosts.split(",") if h]
    opts = NodeOptions(args.model, args.shard, hosts, args.memory_budget, args.backend)
    opts.kv_bits, opts.kv_group_size = args.kv_bits, args.kv_group_size
    return run_node(opts, _server(args.serve) if args.serve else None)


def _server(address: str) -> Any:
    """Rank 0's part under ``serve --hosts``: the ordinary server over a LeaderHost."""
    import os

    host, _, port = address.rpartition(":")

    def lead(channel: Any, group: Any, opts: Any) -> int:
        from engine.runtime.shard_leader import LeaderHost
        from engine.serve.server import serve

        leader = LeaderHost(channel, group, opts)
        try:
            return serve(
                opts.model, host, int(port), api_key=os.environ.get(API_KEY_VARIABLE) or None, model_host=leader
            )
        except EngineError as e:
            channel.send({"error": str(e)})
            return 1
        finally:
            leader.quit()

    return lead


def check_request(args: argparse.Namespace) -> None:
    for attr, flag in _REFUSED:
        if getattr(args, attr, None):
            raise EngineError(f"{flag} does not run sharded yet; leave it out or drop --hosts")


def _vocab(config: Any) -> int:
    from engine.artifacts.config_spellings import text_config

    value = text_config(dict(config.raw)).get("vocab_size")
    return int(value) if isinstance(value, int) else 0


def _check_family(model: str, mode: str) -> Any:
    """A family that does not shard is refused before any rank starts; its config."""
    from engine.artifacts.config import read_config
    from engine.artifacts.hub import resolve_model_path
    from engine.models.sharding import check_family

    path = resolve_model_path(model)
    if path.is_file():
        raise EngineError("a .gguf file does not shard: use the model's safetensors folder")
    config = read_config(path)
    check_family(config.model_type, mode)
    return config


def _check_cache_file(path: str) -> None:
    from pathlib import Path

    target = Path(path)
    if target.suffix != ".safetensors":
        raise EngineError(f"--cache-file must end in .safetensors (got {path})")
    if not target.parent.exists():
        raise EngineError(f"--cache-file: the folder {target.parent} does not exist")


def node_args(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--shard", args.shard or "pipeline"]
    if args.memory_budget is not None:
        out += ["--memory-budget", str(args.memory_budget)]
    if args.kv_bits is not None:
        out += ["--kv-bits", str(args.kv_bits), "--kv-group-size", str(args.kv_group_size)]
    return out


def generate(args: argparse.Namespace, params: Any) -> int:
    """The sharded ``generate``: rank 0's reply printed here."""
    from engine.runtime.shard_group import RankGroup

    check_request(args)
    config = _check_family(args.model, args.shard or "pipeline")
    vocab = _vocab(config)
    if args.prompt_ids is not None and vocab and max(args.prompt_ids, default=0) >= vocab:
        raise EngineError(f"--prompt-ids has id {max(args.prompt_ids)}, past the model's vocabulary of {vocab}")
    if args.prompt_ids is not None and not args.prompt_ids:
        raise EngineError("--prompt-ids is empty: give at least one token id")
    group = RankGroup(args.hosts, node_args(args), backend=args.backend)
    cmd: dict[str, Any] = {"op": "generate_ids", "params": dataclasses.asdict(params)}
    if args.chat:
        messages = [] if args.system is None else [{"role": "system", "content": args.system}]
        cmd = {**cmd, "op": "generate", "messages": [*messages, {"role": "user", "content": args.prompt}]}
    elif args.prompt_ids is not None:
        cmd["ids"] = args.prompt_ids
    else:
        cmd["prompt"] = args.prompt
    group.start()
    try:
        ranks = group.wait_ready(_load_progress(len(group.hosts)) if sys.stderr.isatty() else None)
        if args.cache_file is not None:
            _check_cache_file(args.cache_file)
            group.send({"op": "restore", "session": "", "path": args.cache_file})
            restored = group.expect("restored")
            if restored["why"] and "no saved cache" not in restored["why"]:
                print(f"note: the saved cache was not used: {restored['why']}", file=sys.stderr)
        result = _stream(group, cmd, args.json)
        if args.cache_file is not None:
            group.send({"op": "save", "session": "", "path": args.cache_file})
            group.expect("saved")
    finally:
        group.close()
    if args.json:
        out = {k: v for k, v in result.items() if k != "cached_tokens" or args.cache_file is not None}
        out["ranks"] = ranks
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def serve(args: argparse.Namespace) -> int:
    """``serve --hosts``: rank 0 serves; this process starts the ranks, relays rank 0's
    messages and watches every rank until interrupted or one is lost."""
    from engine.runtime.shard_group import RankGroup

    for flag, value in (("--context-length", getattr(args, "context_length", None)),):
        if value is not None:
            raise EngineError(f"{flag} does not run sharded yet; leave it out or drop --hosts")
    _check_family(args.model, args.shard or "pipeline")
    extra = {API_KEY_VARIABLE: args.api_key} if args.api_key else {}
    node = [*node_args(args), "--serve", f"{args.host}:{args.port}"]
    group = RankGroup(args.hosts, node, backend=args.backend, echo=True, env=extra)
    group.start()
    try:
        for r in group.wait_ready():
            print(
                f"rank {r['rank']} on {r['host']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, "
                f"{r['weight_bytes'] / 1e9:.2f} GB of weights",
                file=sys.stderr,
                flush=True,
            )
        group.watch()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        group.close()
    return 0


def _load_progress(n: int) -> Any:
    """One line on the terminal, rewritten as each rank reads its share."""
    shown = [0.0] * n

    def show(rank: int, done: float, total: float) -> None:
        shown[rank] = done / total if total else 1.0
        parts = "  ".join(f"rank {r} {p:4.0%}" for r, p in enumerate(shown))
        sys.stderr.write(f"\rloading: {parts}" + ("\n" if all(p >= 1.0 for p in shown) else ""))
        sys.stderr.flush()

    return show


def _stream(group: Any, cmd: dict[str, Any], quiet: bool) -> dict[str, Any]:
    events = group.run(cmd)
    while True:
        try:
            obj = next(events)
        except KeyboardInterrupt:
            group.stop()  # every rank ends the reply at the same step
            continue
        except StopIteration:
            raise EngineError("rank 0 ended without a result") from None
        except EngineError:
            sys.stdout.flush()
            raise
        if "token" in obj and not quiet:
            sys.stdout.write(obj["token"])
            sys.stdout.flush()
        if "result" in obj:
            return obj["result"]
