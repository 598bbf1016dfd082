"""The server's side of the thread wall: an EngineWorker, events routed to each request.

HTTP handler threads submit commands and read their own request's events from a queue;
the worker decodes concurrent generations together (continuous batching, see
engine.decode.batch) where the model's family allows, else one at a time in arrival
order. A request whose client has gone is cancelled through the worker's out-of-band
Cancel, which takes only its own sequence out, between decode steps (or prefill chunks).

The backend owns its worker (``python -m engine serve``) or shares one that already
serves a window (``Backend.shared``): the owner then hands every worker event to
``route`` first, which keeps the server's own and lets the rest through.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from engine.api import (
    Cancel,
    Command,
    DoneEvent,
    DropSession,
    ErrorEvent,
    Event,
    LoadModel,
    ModelInfo,
)
from engine.errors import EngineError
from engine.runtime.worker import EngineWorker
from engine.serve.http import ClientGone, ModelLoading

POLL_S = 0.2  # how often a waiting request checks that its client is still there
MAX_SESSIONS = 4  # conversations whose KV caches are kept for prefix reuse


class Backend:
    def __init__(
        self,
        worker: EngineWorker | None = None,
        model_info: Callable[[], ModelInfo | None] | None = None,
        *,
        max_sessions: int = MAX_SESSIONS,
        host: Any = None,
    ) -> None:
        self._queues: dict[int, queue.Queue[Event]] = {}
        # Re-entrant: the worker answers some submits (a Cancel, a dead engine) on the
        # submitting thread, inside submit.
        self._lock = threading.RLock()
        self.owned = worker is None
        self.worker = worker or EngineWorker(self.route, host)  # host: a ModelHost of another kind (sharded)
        self._model_info = model_info
        self._info: ModelInfo | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set when the load ended, either way
        self.model_arg = ""  # the model as the command line named it (also accepted as its id)
        self._pending: queue.Queue[Event] | None = None  # the queue of the submit under way
        self._ignored: set[int] = set()  # requests nobody waits for (dropping a session)
        self._sessions: OrderedDict[str, str] = OrderedDict()  # conversation key -> session id, LRU
        self._session_ids = itertools.count(1)
        self.max_sessions = max(1, max_sessions)  # each holds a KV cache: memory, traded for reuse

    @classmethod
    def shared(cls, worker: EngineWorker, model_info: Callable[[], ModelInfo | None], max_sessions: int = 2) -> Backend:
        """A backend on a worker someone else owns (and feeds events to ``route``);
        ``model_info()`` says which model that worker has loaded now, if any. Fewer kept
        sessions by default: the window's chats hold caches in the same memory budget."""
        backend = cls(worker, model_info, max_sessions=max_sessions)
        backend.loaded.set()
        return backend

    # ---- the model ----------------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        return self._model_info() if self._model_info is not None else self._info

    @property
    def decoding(self) -> int:
        """Generations decoding together in the worker's batch now."""
        return self.worker.status.decoding

    @property
    def host(self) -> Any:
        return self.worker.host

    @property
    def tool_format(self) -> Any:
        """The loaded template's tool-call format (engine.text.tool_calls), if it has one."""
        from engine.text.tool_calls import detect_tool_format

        template = self.host.template if self.host.loaded else None
        return detect_tool_format(getattr(template, "source", None))

    @property
    def default_params(self) -> Any:
        """Generation settings from the model's generation_config.json (reads config only)."""
        return self.host.default_params() if self.host.loaded else None

    def token_text(self, token_id: int) -> str:
        """One token's text (log-prob listings). The tokenizer is Rust code, not MLX: safe here."""
        return self.host.tokenizer.decode([token_id])

    def require_model(self) -> ModelInfo:
        info = self.info
        if info is None:
            if self.load_error is not None:
                raise EngineError(f"The model failed to load: {self.load_error}")
            if not self.owned:
                raise ModelLoading("No model is loaded in the app yet; pick one there first.")
            raise ModelLoading("The model is still loading; try again in a moment.")
        return info

    def start(self, model: str, memory_budget: int | None = None, **options: Any) -> None:
        """Start the owned worker and load ``model`` in the background (``loaded`` tells when);
        ``options`` are LoadModel's (kv_bits, kv_group_size, context_cap)."""
        self.model_arg = model
        self.worker.start()
        command = LoadModel(model, memory_budget, **options)
        threading.Thread(target=self._load, args=(command,), name="serve-load", daemon=True).start()

    def _load(self, command: LoadModel) -> None:
        try:
            for event in self.events(self.submit(command)):
                if isinstance(event, DoneEvent):
                    self._info = event.result
                elif isinstance(event, ErrorEvent):
                    self.load_error = event.message
        finally:
            self.loaded.set()

    # ---- requests -----------------------------------------------------------------

    def session(self, key: str) -> str:
        """The session (KV cache) for a conversation: requests that start alike share one and
        reuse its prefix; past MAX_SESSIONS the least recently used is dropped."""
        with self._lock:
            if key in self._sessions:
                self._sessions.move_to_end(key)
                return self._sessions[key]
            sid = self._sessions[key] = f"serve-{next(self._session_ids)}"
            while len(self._sessions) > self.max_sessions:
                _, old = self._sessions.popitem(last=False)
                self.fire(DropSession(old))
            return sid

    def fire(self, command: Command) -> None:
        """Submit ``command`` with nobody waiting for its answer."""
        with self._lock:
            rid = self.submit(command)
            answered = self._queues.pop(rid)
            if not any(isinstance(e, DoneEvent | ErrorEvent) for e in list(answered.queue)):
                self._ignored.add(rid)

    def route(self, event: Event) -> bool:
        """Called on the worker thread with every event: True when it was one of ours."""
        rid = getattr(event, "request_id", None)
        with self._lock:
            if rid in self._ignored:
                if isinstance(event, DoneEvent | ErrorEvent):
                    self._ignored.discard(rid)
                return True
            q = self._queues.get(rid) if rid is not None else None
            if q is None and self._pending is not None:  # inside submit, on its thread
                q = self._pending
        if q is None:
            return False
        q.put(event)
        return True

    def submit(self, command: Command) -> int:
        with self._lock:
            # Registered before the worker thread can answer (route waits for the lock). An
            # answer given inside submit itself (a dead worker) comes to route on this very
            # thread, and lands in the queue made here.
            self._pending = queue.Queue()
            try:
                rid = self.worker.submit(command)
                self._queues[rid] = self._pending
            finally:
                self._pending = None
        return rid

    def events(self, rid: int, gone: Callable[[], bool] | None = None) -> Iterator[Event]:
        """The request's events up to and including its DoneEvent or ErrorEvent. When
        ``gone()`` turns true the request is cancelled and ClientGone raised."""
        with self._lock:
            q = self._queues.setdefault(rid, queue.Queue())
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = q.get(timeout=POLL_S)
                except queue.Empty:
                    event = None
                # Checked on a clock, not only when idle: tokens may arrive without pause.
                if gone is not None and time.monotonic() - checked >= POLL_S:
                    checked = time.monotonic()
                    if gone():
                        self.cancel(rid)
                        raise ClientGone()
                if event is None:
                    continue
                yield event
                if isinstance(event, DoneEvent | ErrorEvent):
                    return
        finally:
            with self._lock:
                self._queues.pop(rid, None)

    def cancel(self, rid: int) -> None:
        self.worker.submit(Cancel(rid))

    def shutdown(self) -> None:
        if self.owned:
            self.worker.shutdown(timeout=5.0)
