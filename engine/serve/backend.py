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
from engine.runtime.worker import EngineWorker
from engine.serve.http import ClientGone, EngineDown, ModelLoading

POLL_S = 0.2  # how often a waiting request checks that its client is still there
MAX_SESSIONS = 4  # conversations whose KV caches are kept for prefix reuse
MAX_RESTARTS = 3  # fresh engines started after the engine's loop stopped; then requests are refused


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
        self._load_command: LoadModel | None = None  # what start() loaded: a restart loads it again
        self.restarts = 0
        self.last_stop: str | None = None  # why the engine last stopped, when it did
        self._longest: tuple[Any, int] = (None, 0)  # (tokenizer, its longest token's length)
        self._texts: tuple[Any, int | None, dict[int, str]] = (None, None, {})  # (tokenizer, anchor, id -> text)

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
        """The loaded template's tool-call format (engine.text.tool_calls), if it has one: the
        load found it once (ModelInfo.tool_format)."""
        from engine.text.tool_calls import FORMATS

        info = self.info
        return FORMATS.get(info.tool_format or "") if info is not None else None

    @property
    def default_params(self) -> Any:
        """Generation settings from the model's generation_config.json (reads config only)."""
        return self.host.default_params() if self.host.loaded else None

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside running text (log-prob listings), so a reply's
        tokens join to its text: decoded after an anchor token and the anchor's text taken
        off, since a SentencePiece decoder drops a lone token's leading space ("▁the" ->
        "the"). Kept per token id. The tokenizer is Rust code, not MLX: safe on any thread."""
        tokenizer = self.host.tokenizer
        if self._texts[0] is not tokenizer:
            anchor = tokenizer.encode("a", add_special_tokens=False)
            self._texts = (tokenizer, anchor[-1] if anchor else None, {})
        _, anchor_id, texts = self._texts
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self._decode_in_text(tokenizer, anchor_id, token_id)
        return text

    @staticmethod
    def _decode_in_text(tokenizer: Any, anchor: int | None, token_id: int) -> str:
        alone = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        if anchor is None:
            return alone
        head = tokenizer.decode([anchor], clean_up_tokenization_spaces=False)
        both = tokenizer.decode([anchor, token_id], clean_up_tokenization_spaces=False)
        return both[len(head) :] if both.startswith(head) else alone

    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token (byte-level tokens spell one byte a
        character): no text of N characters takes fewer than N / this tokens."""
        tokenizer = self.host.tokenizer
        if self._longest[0] is not tokenizer:
            vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
            self._longest = (tokenizer, max((len(t) for t in vocab), default=0))
        return self._longest[1]

    def special_texts(self) -> frozenset[str]:
        """The special tokens' literal texts (``<|endoftext|>``, ``<s>``), which replies leave
        out unless the request asks for them (``skip_special_tokens: false``)."""
        tokenizer = self.host.tokenizer
        texts = (tokenizer.id_to_token(i) for i in tokenizer.special_token_ids)
        return frozenset(t for t in texts if t)

    @property
    def stopped(self) -> str | None:
        """Why the engine's loop stopped for good (it refuses every command since), or None."""
        return self.worker.dead

    def revive(self) -> bool:
        """When the engine this backend owns has stopped: start a fresh one and load the model
        again in the background, at most MAX_RESTARTS times. True when one is starting (or
        already running); False when the engine stays stopped (a shared one, or too many)."""
        with self._lock:
            reason = self.worker.dead
            if reason is None:
                return True
            if not self.owned or self._load_command is None or self.restarts >= MAX_RESTARTS:
                return False
            self.restarts += 1
            self.last_stop = reason
            self.worker = EngineWorker(self.route)
            self._info, self.load_error = None, None
            self.loaded.clear()
            self._sessions.clear()  # their caches died with the old engine
            self.worker.start()
            command = self._load_command
        threading.Thread(target=self._load, args=(command,), name="serve-reload", daemon=True).start()
        return True

    def require_model(self) -> ModelInfo:
        reason = self.stopped
        if reason is not None:
            if self.revive():
                raise ModelLoading(f"The engine stopped ({reason}); it is restarting: try again in a moment.")
            raise EngineDown(f"The engine stopped ({reason}) and was not restarted; restart the server.")
        info = self.info
        if info is None:
            if self.load_error is not None:
                raise EngineDown(f"The model failed to load: {self.load_error}")
            if not self.owned:
                raise ModelLoading("No model is loaded in the app yet; pick one there first.")
            raise ModelLoading("The model is still loading; try again in a moment.")
        return info

    def start(self, model: str, memory_budget: int | None = None, **options: Any) -> None:
        """Start the owned worker and load ``model`` in the background (``loaded`` tells when);
        ``options`` are LoadModel's (kv_bits, kv_group_size, context_cap)."""
        self.model_arg = model
        self.worker.start()
        command = self._load_command = LoadModel(model, memory_budget, **options)
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
