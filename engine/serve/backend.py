"""The server's side of the thread wall: one EngineWorker, events routed to each request.

HTTP handler threads submit commands and read their own request's events from a queue;
the worker runs commands one at a time in arrival order, so concurrent requests queue
fairly behind each other. A request whose client has gone is cancelled through the
worker's out-of-band Cancel, which stops it between decode steps (or prefill chunks).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..api import Cancel, Command, DoneEvent, ErrorEvent, Event, LoadModel, ModelInfo
from ..errors import EngineError
from ..host import ModelHost
from ..worker import EngineWorker
from .http import ClientGone, ModelLoading

POLL_S = 0.2  # how often a waiting request checks that its client is still there


class Backend:
    def __init__(self) -> None:
        self._host = ModelHost()
        self._queues: dict[int, queue.Queue[Event]] = {}
        # Re-entrant: the worker answers some submits (a Cancel, a dead engine) on the
        # submitting thread, inside submit.
        self._lock = threading.RLock()
        self.worker = EngineWorker(self._route, self._host)
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set when the load ended, either way
        self.tool_format: Any = None  # engine.text.tool_calls.ToolCallFormat, if the template has one
        self.default_params: Any = None
        self.model_arg = ""  # the model as the command line named it (also accepted as its id)

    def _route(self, event: Event) -> None:
        rid = getattr(event, "request_id", None)
        if rid is None:  # memory figures: nobody here asks for them
            return
        with self._lock:
            q = self._queues.setdefault(rid, queue.Queue())
        q.put(event)

    def start(self, model: str, memory_budget: int | None = None) -> None:
        """Start the worker and load ``model`` in the background (``loaded`` tells when)."""
        self.model_arg = model
        self.worker.start()
        threading.Thread(target=self._load, args=(model, memory_budget), name="serve-load", daemon=True).start()

    def _load(self, model: str, memory_budget: int | None) -> None:
        try:
            for event in self.events(self.submit(LoadModel(model, memory_budget))):
                if isinstance(event, DoneEvent):
                    self._ready(event.result)
                elif isinstance(event, ErrorEvent):
                    self.load_error = event.message
        finally:
            self.loaded.set()

    def _ready(self, info: ModelInfo) -> None:
        from ..text.tool_calls import detect_tool_format

        self.tool_format = detect_tool_format(getattr(self._host.template, "source", None))
        self.default_params = self._host.default_params()  # reads the model's config only
        self.info = info

    def require_model(self) -> ModelInfo:
        if self.info is None:
            if self.load_error is not None:
                raise EngineError(f"The model failed to load: {self.load_error}")
            raise ModelLoading("The model is still loading; try again in a moment.")
        return self.info

    def token_text(self, token_id: int) -> str:
        """One token's text (log-prob listings). The tokenizer is Rust code, not MLX: safe here."""
        return self._host.tokenizer.decode([token_id])

    def submit(self, command: Command) -> int:
        with self._lock:
            # Registered before the worker can answer, so no event is missed.
            rid = self.worker.submit(command)
            self._queues.setdefault(rid, queue.Queue())
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
        with self._lock:
            self._queues.pop(self.worker.submit(Cancel(rid)), None)

    def shutdown(self) -> None:
        self.worker.shutdown(timeout=5.0)
