"""Rank 0 of a sharded model behind the ordinary worker: ``serve --hosts`` and the like.

``LeaderHost`` is a ModelHost that keeps the other ranks in step with it. Every call
that runs the model or changes a session's cache is first handed to every rank (the
same command protocol shard_rank.py's followers obey): loading (the per-rank plan, then
each rank's share), generating (from messages or ids; the request's own cancel event
becomes the stop flag every rank sees at the same step) and dropping a session. What
cannot run split yet (adapters, a draft model, saved caches, media, batching) is
refused in one line; a forward pass the other ranks were not told of raises instead of
waiting for them forever (``ShardSpec.guarded``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from engine.api import Complete, Generate
from engine.errors import EngineError
from engine.runtime.host import ModelHost
from engine.runtime.shard_rank import Channel, NodeOptions, _Node, broadcast_json, prepare, report_ready

_NOT_YET = "does not run on a model split across machines yet"


class LeaderHost(ModelHost):
    def __init__(self, channel: Channel, group: Any, opts: NodeOptions) -> None:
        super().__init__()
        self._channel, self._group, self._opts = channel, group, opts
        self._node = _Node(self)
        self._loads = 0

    # ---- loading ------------------------------------------------------------------

    def load(self, path: str, budget: int | None = None, progress: Any = None, cancel: Any = None, **kw: Any) -> Any:
        kw.setdefault("kv_bits", self._opts.kv_bits)
        kw.setdefault("kv_group_size", self._opts.kv_group_size)
        opts = dataclasses.replace(self._opts, model=path)
        if self._loads:  # the followers wait for commands now, not for the first plan
            broadcast_json(self._group, {"op": "load", "model": path, "shard": opts.mode})
        self._loads += 1
        mine = prepare(self._channel, self._group, self._node, opts)
        if mine is None:
            raise EngineError(f"{path} cannot be split across these machines (see the launcher's message)")
        self._node.spec.guarded = True
        info = super().load(path, opts.budget if budget is None else budget, progress, cancel, **kw)
        report_ready(self._channel, self._node, opts, mine)
        return info

    @property
    def batch(self) -> Any:
        return None  # one generation at a time: every rank runs the same one

    # ---- generating -----------------------------------------------------------------

    def open_request(self, command: Generate | Complete, on_event: Any = None, cancel: Any = None, *, request_id: int = 0, session_id: str | None = None, batch: Any = None, **template_kwargs: Any) -> Iterator[Any]:  # fmt: skip
        """The host's one generate entry, handed to every rank first (the older generate
        methods reach it too, so each request is mirrored exactly once)."""
        sid = command.session_id if session_id is None else session_id
        cmd: dict[str, Any]
        if isinstance(command, Complete):
            prompt = command.prompt
            ids = self.encode_prompt(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
            command = dataclasses.replace(command, prompt=ids)
            cmd = {"op": "generate_ids", "session": sid, "ids": ids, "params": dataclasses.asdict(command.params)}
        else:
            if command.media:
                raise EngineError(f"media {_NOT_YET}")
            self.check_media(command.messages, command.media)
            cmd = {
                "op": "generate",
                "session": sid,
                "messages": list(command.messages),
                "params": dataclasses.asdict(command.params),
                "tools": command.tools,
                "add_generation_prompt": command.add_generation_prompt,
                "template_kwargs": template_kwargs,
            }
        base = super().open_request
        mirrored = command

        def stream(agreed: threading.Event) -> Iterator[Any]:
            return base(mirrored, on_event, agreed, request_id=request_id, session_id=sid, **template_kwargs)

        return self._mirrored(cmd, stream, cancel)

    def _mirrored(self, cmd: dict[str, Any], stream: Any, cancel: threading.Event | None) -> Iterator[Any]:
        spec = self._node.spec
        if spec is None:
            raise EngineError("No model is loaded: load one first.")
        broadcast_json(self._group, cmd)
        spec.begin()
        spec.requested = cancel if cancel is not None else threading.Event()
        spec.mirrored = True
        try:
            yield from stream(spec.agreed)
        finally:
            spec.mirrored = False

    def drop_session(self, session_id: str) -> None:
        if self._node.spec is not None:
            broadcast_json(self._group, {"op": "drop", "session": session_id})
        super().drop_session(session_id)

    def quit(self) -> None:
        """End every other rank (they leave their command loop)."""
        broadcast_json(self._group, {"op": "quit"})

    # ---- what does not run split yet ---------------------------------------------------

    def load_draft(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError(f"a draft model {_NOT_YET}")

    def mount_adapter(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError(f"an adapter {_NOT_YET}")

    def restore_session(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError(f"a saved cache {_NOT_YET}")

    def save_session(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError(f"a saved cache {_NOT_YET}")
