"""EngineBridge: awaitable calls into the engine's worker thread, Qt signals out.

The worker calls ``_on_worker_event`` on its own thread. That method only emits a
signal; the queued connection moves the event onto the GUI thread, where futures
are resolved, the request's own ``RequestEvents`` hear it (what the caller of
``generate``, ``load_model`` or ``transcribe`` passed), and the public signals fire for
observers. Nothing here touches a widget. Slow work that is not the engine's is an
``app.ops.Op``, not a bridge call.

engine.runtime.worker (and with it mlx) is imported lazily, on ``start()``, so the window
can appear before the heavy imports run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from app.qt import QObject, Qt, Signal, emit
from engine import api


class EngineUnavailable(RuntimeError):
    """The engine could not be started (import failure, worker died)."""


@dataclass(frozen=True)
class RequestEvents:
    """What one request's consumer hears while it runs, on the GUI thread and in order: only
    that request's events, so the consumer need not filter the bridge's signals (which every
    request's events still pass, for observers) by request id. Nothing arrives once the
    awaited call has returned or been cancelled."""

    token: Callable[[str, str], None] | None = None  # text, channel ("answer" | "reasoning")
    draft: Callable[[str, str], None] | None = None  # the refining diffusion block: answer, thinking
    progress: Callable[[str, float, float, str], None] | None = None  # stage, done, total, message


class EngineBridge(QObject):
    token = Signal(int, str, str)  # request id, text, channel ("answer" | "reasoning")
    # request id, the diffusion block still refining (replaces the last): its answer part, its thinking part
    draft = Signal(int, str, str)
    progress = Signal(int, str, float, float, str)  # request id, stage, done, total, message
    memory = Signal(dict)  # MemoryEvent fields
    error = Signal(int, str)  # request id, one readable line
    finished = Signal(int, object)  # request id, GenerationResult | ModelInfo | None
    started = Signal(int, str)  # request id, kind ("generate", "load", "inspect", ...)
    train_progress = Signal(object)  # api.TrainProgress: an iteration or a validation pass done
    _event = Signal(object)  # worker thread -> GUI thread

    def __init__(self, parent: QObject | None = None, worker_factory: Callable[..., Any] | None = None):
        super().__init__(parent)
        self._worker_factory = worker_factory
        self._worker: Any = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._kinds: dict[int, str] = {}
        self._listeners: dict[int, RequestEvents] = {}  # request id -> its consumer's callbacks
        self.active_generation: int | None = None
        self.active_load: int | None = None
        self.active_transcription: int | None = None
        self.active_training: int | None = None
        self.model_info: api.ModelInfo | None = None
        self._loading: asyncio.Future[Any] | None = None  # the load under way, if any
        self._live: tuple[int, api.GenerationStats] | None = None  # latest token's stats
        # Listeners that see every worker event first, on the worker thread (the local
        # server's requests); one that returns True keeps the event for itself.
        self._taps: list[Callable[[Any], bool]] = []
        self._event.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)

    # ---- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        if self._worker is not None:
            return
        factory = self._worker_factory
        if factory is None:
            try:
                from engine.runtime.worker import EngineWorker  # heavy: imports mlx
            except Exception as exc:  # noqa: BLE001 - any import failure is shown to the user
                from engine.errors import backend_hint

                reason = backend_hint(exc) or str(exc)
                raise EngineUnavailable(f"The engine could not start: {reason}") from exc
            factory = EngineWorker
        self._worker = factory(self._on_worker_event)
        self._worker.start()

    @property
    def running(self) -> bool:
        return self._worker is not None

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._worker is None:
            return
        for rid in list(self._pending):
            self._submit_quiet(api.Cancel(target=rid))
        self._worker.shutdown(timeout)
        self._worker = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable("The engine was shut down."))
        self._pending.clear()
        self._listeners.clear()

    # ---- awaitable calls ------------------------------------------------------------

    async def load_model(
        self,
        path: str,
        memory_budget: int | None = None,
        prepare: Callable[[api.ModelInfo], Awaitable[Any]] | None = None,
        kv_bits: int | None = None,
        context_cap: int | None = None,
        paged_kv_block_size: int | None = None,
        events: RequestEvents | None = None,
        hosts: list[str] | None = None,
        shard: str = "pipeline",
        backend: str = "any",
    ) -> api.ModelInfo:
        """Load a model (its progress to ``events``). ``prepare(info)`` runs once it has loaded
        (re-mounting adapters, say); until it is done the load still counts as under way, so
        ``wait_for_load`` waits too."""
        command = api.LoadModel(
            path=path,
            memory_budget=memory_budget,
            kv_bits=kv_bits,
            context_cap=context_cap,
            paged_kv_block_size=paged_kv_block_size,  # blocks shared between chats and requests
            paged_kv_where_possible=True,  # Settings' choice holds for every model: one that cannot page loads unpaged
        )
        command.hosts, command.shard, command.backend = hosts, shard, backend  # ``hosts``: split across them
        rid, fut = self._request(command, "load", events)
        self.active_load = rid
        ready = asyncio.get_running_loop().create_future()
        self._loading = ready
        info: api.ModelInfo | None = None
        try:
            info = await fut
            self.model_info = info
            if self.active_load == rid:
                self.active_load = None
            if prepare is not None:
                await prepare(info)
        finally:
            if self.active_load == rid:
                self.active_load = None
            if self._loading is ready:
                self._loading = None
            if not ready.done():  # None: the load failed (a waiting message is not answered)
                ready.set_result(info)
        assert info is not None  # a failed load raised above
        return info

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    async def wait_for_load(self) -> api.ModelInfo | None:
        """The model being loaded, once it is ready; the current one when nothing is
        loading; None when the load fails or is cancelled."""
        fut = self._loading
        if fut is None:
            return self.model_info
        return await asyncio.shield(fut)

    async def unload_model(self) -> None:
        _, fut = self._request(api.UnloadModel(), "unload")
        await fut
        self.model_info = None

    # ---- adapters and the draft model (the worker answers with the ModelInfo as it is now)

    async def mount_adapter(self, path: str, name: str | None = None) -> api.AdapterInfo:
        """Mount an adapter folder on the loaded model, inactive."""
        _, fut = self._request(api.MountAdapter(path=path, name=name), "adapter")
        adapter: api.AdapterInfo = await fut
        await self.refresh_model_info()
        return adapter

    async def set_active_adapters(self, scales: dict[str, float]) -> api.ModelInfo:
        """Make exactly these mounted adapters active (name -> scale)."""
        _, fut = self._request(api.SetActiveAdapters(scales=dict(scales)), "adapter")
        info: api.ModelInfo = await fut
        self.model_info = info
        return info

    async def unmount_adapter(self, name: str) -> api.ModelInfo:
        _, fut = self._request(api.UnmountAdapter(name=name), "adapter")
        info: api.ModelInfo = await fut
        self.model_info = info
        return info

    async def load_draft_model(self, path: str | None) -> api.ModelInfo | None:
        """Load the draft model for speculative decoding (None unloads it)."""
        _, fut = self._request(api.LoadDraftModel(path=path), "draft")
        draft: api.ModelInfo | None = await fut
        await self.refresh_model_info()
        return draft

    async def load_embedder(self, path: str | None) -> api.ModelInfo | None:
        """Load a sentence embedding model beside the chat model, for documents (None unloads it)."""
        _, fut = self._request(api.LoadEmbedder(path=path), "embedder")
        info: api.ModelInfo | None = await fut
        return info

    async def embed_beside(self, texts: list[str]) -> list[list[float]]:
        """Vectors from the embedding model loaded beside the chat model (one request: the
        worker takes other requests between two calls)."""
        _, fut = self._request(api.Embed(inputs=list(texts), beside=True), "embed")
        result: api.Embeddings = await fut
        return result.vectors

    async def refresh_model_info(self) -> api.ModelInfo | None:
        _, fut = self._request(api.GetModelInfo(), "info")
        info: api.ModelInfo | None = await fut
        self.model_info = info
        return info

    async def plan_shards(self, path: str, hosts: list[str], rooms: list[int], shard: str) -> api.ShardPlan:
        _, fut = self._request(api.PlanShards(path, hosts, rooms, shard), "inspect")
        plan: api.ShardPlan = await fut
        return plan

    async def inspect(self, path: str) -> api.ModelInfo:
        _, fut = self._request(api.InspectModel(path=path), "inspect")
        info: api.ModelInfo = await fut
        return info

    async def generate(
        self,
        conversation_id: int | str,
        messages: list[dict[str, Any]],
        params: api.GenerationParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        events: RequestEvents | None = None,
    ) -> api.GenerationResult:
        """Stream a reply: its pieces go to ``events`` (and to the ``token`` signal). Resolves
        with the final result. ``tools`` (OpenAI function entries) go to the chat template."""
        cmd = api.Generate(
            session_id=str(conversation_id),
            messages=messages,
            params=params or api.GenerationParams(),
            tools=tools or None,
        )
        rid, fut = self._request(cmd, "generate", events)
        result: api.GenerationResult = await self._while_active(rid, fut, "active_generation")
        return result

    async def decide(
        self, messages: list[dict[str, Any]], candidates: list[str], media: list[api.MediaInput] | None = None
    ) -> api.Decision:
        """Score each candidate answer after ``messages`` (decision scoring); it runs on the
        worker between generation steps, on caches of its own."""
        _, fut = self._request(api.Decide(candidates=candidates, messages=messages, media=media or []), "decide")
        result: api.Decision = await fut
        return result

    async def train(self, command: api.Train) -> api.TrainResult:
        """Train an adapter on the loaded model; progress arrives on ``train_progress``.
        ``cancel(active_training)`` stops it with the adapter trained so far saved."""
        rid, fut = self._request(command, "train")
        result: api.TrainResult = await self._while_active(rid, fut, "active_training")
        return result

    async def transcribe(
        self,
        path: str,
        model_path: str | None = None,
        language: str | None = None,
        events: RequestEvents | None = None,
    ) -> api.Transcript:
        """Speech to text with a Whisper model (progress to ``events``, stage as the engine
        names it); resolves with the engine's Transcript. Cancel with
        ``cancel(bridge.active_transcription)``."""
        command = api.Transcribe(path=path, model_path=model_path, language=language)
        rid, fut = self._request(command, "transcribe", events)
        transcript: api.Transcript = await self._while_active(rid, fut, "active_transcription")
        return transcript

    async def _while_active(self, rid: int, fut: asyncio.Future[Any], attr: str) -> Any:
        """Await a cancellable request, with its id in ``attr`` meanwhile; cancelling the
        awaiting task cancels the request in the engine too."""
        setattr(self, attr, rid)
        try:
            return await fut
        except asyncio.CancelledError:
            self._listeners.pop(rid, None)  # nobody listens any more, though the engine may still send
            self._submit_quiet(api.Cancel(target=rid))
            raise
        finally:
            if getattr(self, attr) == rid:
                setattr(self, attr, None)

    def engine_status(self) -> dict[str, Any]:
        """What the engine holds now, for the memory display and tests: whether a model is
        loaded and whether any image/audio tower's weights are in memory, as the worker
        published them (a frozen snapshot) when it finished its last command."""
        status = self._worker.status if self._worker is not None else api.EngineStatus()
        return {"model_loaded": status.model_loaded, "tower_loaded": status.tower_loaded}

    def live_stats(self, request_id: int | None) -> api.GenerationStats | None:
        """The stats that came with the latest token of ``request_id`` (None before one)."""
        if self._live is not None and self._live[0] == request_id:
            return self._live[1]
        return None

    def cancel(self, request_id: int | None = None) -> bool:
        """Stop a request (default: the running generation, else the running load)."""
        target = request_id or self.active_generation or self.active_load
        if target is None or self._worker is None:
            return False
        self._submit_quiet(api.Cancel(target=target))
        return True

    async def save_session(self, conversation_id: int | str, path: str) -> int:
        """Save the conversation's KV cache to ``path``; resolves with the bytes written."""
        _, fut = self._request(api.SaveSession(session_id=str(conversation_id), path=path), "save-cache")
        written: int = await fut
        return written

    def save_session_soon(self, conversation_id: int | str, path: str) -> None:
        """Queue a save without waiting for it (at quit: the worker writes it before it stops)."""
        if self._worker is not None:
            self._submit_quiet(api.SaveSession(session_id=str(conversation_id), path=path))

    async def restore_session(self, conversation_id: int | str, path: str) -> api.SessionRestore:
        """Before a conversation's first turn in this engine: use its saved cache if it fits."""
        _, fut = self._request(api.RestoreSession(session_id=str(conversation_id), path=path), "restore-cache")
        restored: api.SessionRestore = await fut
        return restored

    def drop_session(self, conversation_id: int | str) -> None:
        if self._worker is not None:
            self._submit_quiet(api.DropSession(session_id=str(conversation_id)))

    # ---- plumbing ------------------------------------------------------------------

    def _request(self, command: Any, kind: str, events: RequestEvents | None = None) -> tuple[int, asyncio.Future[Any]]:
        if self._worker is None:
            self.start()
        fut = asyncio.get_running_loop().create_future()
        rid = self._worker.submit(command)
        self._pending[rid] = fut
        self._kinds[rid] = kind
        if events is not None:  # before any event: they reach this thread queued
            self._listeners[rid] = events
        emit(self.started, rid, kind)
        return rid, fut

    def _submit_quiet(self, command: Any) -> None:
        try:
            self._worker.submit(command)
        except Exception:  # noqa: BLE001 - a cancel to a dead worker has nothing to stop
            pass

    @property
    def worker(self) -> Any:
        """The running EngineWorker (started if need be), for sharing with the local server."""
        if self._worker is None:
            self.start()
        return self._worker

    def add_event_tap(self, tap: Callable[[Any], bool]) -> None:
        self._taps.append(tap)

    def remove_event_tap(self, tap: Callable[[Any], bool]) -> None:
        if tap in self._taps:
            self._taps.remove(tap)

    def _on_worker_event(self, event: Any) -> None:
        """Runs on the worker thread: hand over to the GUI thread and return at once."""
        for tap in list(self._taps):
            if tap(event):
                return
        emit(self._event, event)

    def _dispatch(self, event: Any) -> None:
        listener = self._listeners.get(getattr(event, "request_id", 0))
        if isinstance(event, api.TokenEvent):
            self._live = (event.request_id, event.stats)
            if listener is not None and listener.token is not None:
                listener.token(event.text, event.channel)
            emit(self.token, event.request_id, event.text, event.channel)
        elif isinstance(event, api.DraftEvent):
            if listener is not None and listener.draft is not None:
                listener.draft(event.text, event.reasoning)
            emit(self.draft, event.request_id, event.text, event.reasoning)
        elif isinstance(event, api.ProgressEvent):
            if listener is not None and listener.progress is not None:
                listener.progress(event.stage, float(event.done), float(event.total), event.message)
            emit(
                self.progress,
                event.request_id,
                event.stage,
                float(event.done),
                float(event.total),
                event.message,
            )
        elif isinstance(event, api.MemoryEvent):
            emit(self.memory, asdict(event))
        elif isinstance(event, api.TrainProgress):
            emit(self.train_progress, event)
        elif isinstance(event, api.DoneEvent):
            self._kinds.pop(event.request_id, None)
            self._listeners.pop(event.request_id, None)
            fut = self._pending.pop(event.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(event.result)
            emit(self.finished, event.request_id, event.result)
        elif isinstance(event, api.ErrorEvent):
            self._kinds.pop(event.request_id, None)
            self._listeners.pop(event.request_id, None)
            fut = self._pending.pop(event.request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineRequestError(event.message, event.kind))
            emit(self.error, event.request_id, event.message)


class EngineRequestError(Exception):
    """A request ended with the engine's ErrorEvent; ``str()`` is its readable line."""

    def __init__(self, message: str, kind: str = "EngineError"):
        super().__init__(message)
        self.kind = kind
