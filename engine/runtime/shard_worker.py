"""The worker's side of a model split across machines (``LoadModel(hosts=...)``).

The worker's own process never joins the group: MLX forms a distributed group once per
process, and the next load may be on fewer machines. Instead every rank, rank 0
included, is a ``python -m engine node`` process started through the launcher
(shard_group.RankGroup: local processes for 127.0.0.1, ``ssh`` otherwise), and rank 0
runs each request with the leader's protocol (shard_rank.py), handing it to every rank.
``ShardedModel`` turns the worker's commands into that protocol and rank 0's lines back
into the engine's events: load progress per rank, tokens, the result. A lost rank ends
the reply with its one line (the text so far was already sent) and ends every other
rank; nothing is left running once ``close`` returns. Mlx-free.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from engine.api import (
    Complete,
    Generate,
    GenerationResult,
    GenerationStats,
    LoadModel,
    ModelInfo,
    PlanShards,
    ProgressEvent,
    RankShare,
    ShardPlan,
    TokenEvent,
)
from engine.errors import EngineError, OutOfMemoryBudget
from engine.shard_api import SHARD_BACKENDS, SHARD_MODES

Emit = Callable[[Any], None]


def plan_shards(command: PlanShards) -> ShardPlan:
    """The launcher's per-rank plan for ``command``, from the checkpoint's headers."""
    from engine.artifacts.config import read_config
    from engine.artifacts.hub import resolve_model_path
    from engine.models import get_family
    from engine.models.sharding import check_family
    from engine.runtime.shard_plan import checkpoint_sizes, plan_pipeline, plan_tensor

    if len(command.hosts) != len(command.rooms) or len(command.hosts) < 2:
        raise EngineError("a split needs two or more machines, each with its room")
    path = resolve_model_path(command.path)
    config = read_config(path)
    try:
        check_family(config.model_type, command.shard)
    except EngineError as e:
        return ShardPlan(False, reason=str(e))
    args = get_family(config.model_type).ModelArgs.from_dict(config.raw)
    sizes = checkpoint_sizes(path, int(args.num_hidden_layers), bool(getattr(args, "tie_word_embeddings", False)))
    planner = plan_pipeline if command.shard == "pipeline" else plan_tensor
    try:
        shares = planner(sizes, list(command.rooms), list(command.hosts))
    except OutOfMemoryBudget as e:
        return ShardPlan(False, reason=str(e))
    return ShardPlan(True, [RankShare(s.rank, s.host, s.need, [s.start, s.end], s.room) for s in shares])


class ShardedModel:
    """The ranks of one sharded load, driven from the worker thread."""

    def __init__(self, group: Any, front: Any, ranks: list[RankShare]) -> None:
        self.group, self.front, self.ranks = group, front, ranks
        self.info: ModelInfo = front.info

    @classmethod
    def load(cls, rid: int, command: LoadModel, emit: Emit, cancel: threading.Event) -> ShardedModel:
        """Start one rank per host and wait until each has loaded its share, reporting
        each rank's progress; a refusal or a lost rank raises with its one line."""
        from engine.runtime.shard_front import SplitFront
        from engine.runtime.shard_group import RankGroup

        hosts = list(command.hosts or [])
        if command.shard not in SHARD_MODES:
            raise EngineError(f"shard must be one of {', '.join(SHARD_MODES)} (got {command.shard!r})")
        if command.backend not in SHARD_BACKENDS:
            raise EngineError(f"backend must be one of {', '.join(SHARD_BACKENDS)} (got {command.backend!r})")
        front = SplitFront(command.path)  # the tokenizer and template stay here
        info = front.info
        node = ["--model", command.path, "--shard", command.shard]
        if command.kv_bits is not None:
            node += ["--kv-bits", str(command.kv_bits), "--kv-group-size", str(command.kv_group_size)]
        group = RankGroup(hosts, node, backend=command.backend)
        shown = [0.0] * len(hosts)

        def progress(rank: int, done: float, total: float) -> None:
            shown[rank] = done / total if total else 1.0
            if cancel.is_set():
                raise EngineError("the load was cancelled")
            words = "  ".join(f"rank {r} on {h}: {p:.0%}" for r, (h, p) in enumerate(zip(hosts, shown)))
            emit(ProgressEvent(rid, "load", sum(shown), float(len(hosts)), words))

        group.start()
        try:
            ready = group.wait_ready(progress)  # closes the group itself when it raises
        except EngineError as e:
            raise EngineError(f"could not load {info.name} across {len(hosts)} machines: {e}") from None
        ranks = [RankShare(r["rank"], r["host"], int(r["weight_bytes"]), list(r["layers"])) for r in ready]
        return cls(group, front, ranks)

    def generate(self, rid: int, command: Generate | Complete, cancel: threading.Event, emit: Emit) -> GenerationResult:
        """One request on every rank; rank 0's tokens as TokenEvents, its result returned."""
        cmd = _command(command)
        finished = threading.Event()
        threading.Thread(target=self._stop_on, args=(cancel, finished), daemon=True).start()
        try:
            for obj in self.group.run(cmd):
                if "token" in obj:
                    channel = obj.get("channel") or "answer"
                    emit(TokenEvent(rid, obj["token"], channel, list(obj.get("ids") or []), GenerationStats()))
                if "result" in obj:
                    return _result(obj["result"])
        finally:
            finished.set()
        raise EngineError("rank 0 ended the reply without a result")

    def _stop_on(self, cancel: threading.Event, finished: threading.Event) -> None:
        """Stop reaches every rank at the same step (rank 0 hands the flag on)."""
        while not finished.is_set():
            if cancel.wait(0.05):
                if not finished.is_set():
                    try:
                        self.group.stop()
                    except EngineError:
                        pass  # the group is lost: the reply ends with that line anyway
                return

    def drop_session(self, session_id: str) -> None:
        self.group.send({"op": "drop", "session": session_id})

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    def close(self) -> None:
        self.group.close()


def _command(command: Generate | Complete) -> dict[str, Any]:
    params = dataclasses.asdict(command.params)
    if isinstance(command, Complete):
        key = "prompt" if isinstance(command.prompt, str) else "ids"
        return {"op": "generate_ids", "session": command.session_id, key: command.prompt, "params": params}
    if command.media:
        raise EngineError("images, audio and video do not run on a model split across machines yet")
    return {
        "op": "generate",
        "session": command.session_id,
        "messages": list(command.messages),
        "params": params,
        "tools": command.tools,
        "add_generation_prompt": command.add_generation_prompt,
    }


def _result(r: dict[str, Any]) -> GenerationResult:
    stats = GenerationStats(
        prompt_tokens=r.get("prompt_tokens", 0),
        cached_tokens=r.get("cached_tokens", 0),
        generated_tokens=r.get("generated_tokens", 0),
        prompt_tps=r.get("prompt_tps", 0.0),
        generation_tps=r.get("generation_tps", 0.0),
        peak_memory_bytes=r.get("peak_memory_bytes", 0),
    )
    return GenerationResult(
        r.get("text", ""),
        r.get("reasoning", ""),
        list(r.get("token_ids") or []),
        r.get("token_logprobs"),
        r.get("finish_reason", "stop"),
        stats,
    )


NOT_MINE = object()  # the command is the worker's own to run
# What needs the whole model in this process: refused while a split model is loaded.
_NOT_SPLIT = {
    "MountAdapter": "an adapter",
    "SetActiveAdapters": "an adapter",
    "UnmountAdapter": "an adapter",
    "LoadDraftModel": "a draft model",
    "SaveSession": "a saved cache",
    "RestoreSession": "a saved cache",
    "ScorePrompt": "prompt scoring",
    "Decide": "decision scoring",
    "Train": "training",
}


class ShardRouter:
    """The worker's one hook: the commands that go to the ranks while a split model is
    loaded (and the load and plan that start it); everything else is ``NOT_MINE``."""

    def __init__(self, host: Any, emit: Emit, on_lost: Callable[[], None]) -> None:
        self.host, self.emit, self.on_lost = host, emit, on_lost  # on_lost: the split is gone
        self.model: ShardedModel | None = None

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def front(self) -> Any:
        """The split model's text side (shard_front.SplitFront), None when none is loaded."""
        return self.model.front if self.model is not None else None

    def ranks(self) -> list[RankShare]:
        return list(self.model.ranks) if self.model is not None else []

    def handle(self, rid: int, command: Any, cancel: threading.Event) -> Any:
        from engine.api import DropSession, GetModelInfo, UnloadModel

        if isinstance(command, PlanShards):
            return plan_shards(command)
        if isinstance(command, LoadModel):
            self.close()  # a new load replaces the split, whichever kind it is
            if not command.hosts:
                return NOT_MINE
            if self.host.loaded:
                self.host.unload()  # this process holds no share of a split model
            self.model = ShardedModel.load(rid, command, self.emit, cancel)
            return self.model.info
        if self.model is None:
            return NOT_MINE
        if isinstance(command, UnloadModel):
            self.close()
            return None
        if isinstance(command, Generate | Complete):
            return self._generate(rid, command, cancel)
        if isinstance(command, DropSession):
            self.model.drop_session(command.session_id)
            return None
        if isinstance(command, GetModelInfo):
            return self.model.info
        what = _NOT_SPLIT.get(type(command).__name__)
        if what is not None:
            raise EngineError(f"{what} does not run on a model split across machines yet")
        return NOT_MINE

    def _generate(self, rid: int, command: Generate | Complete, cancel: threading.Event) -> Any:
        from engine.runtime.shard_group import RankLost

        assert self.model is not None
        try:
            return self.model.generate(rid, command, cancel, self.emit)
        except RankLost as e:  # the group is gone (every rank ended): so is the model
            self.model = None
            self.on_lost()
            raise EngineError(f"{e}; the model is unloaded, load it again on the machines left") from None

    def close(self) -> None:
        model, self.model = self.model, None
        if model is not None:
            model.close()
