"""EngineWorker: the one thread that owns MLX. Commands in, events out.

Callers on any thread ``submit`` commands and get a request id back at once; events
for that id come back through the ``on_event`` callback (called on the worker thread,
so it must be thread-safe: the app's bridge re-emits them as Qt signals). A Cancel is
handled out of band: it sets the target's cancel flag immediately, without queueing
behind the generation it is meant to stop. An exception ends its request with an
ErrorEvent and the worker carries on; should the loop itself die, every waiting
request is told.

Generations on a model whose family batches (engine.decode.batch) decode together: each
one that arrives becomes a job in the batch at once, and the worker goes round the jobs
(each takes its tokens) and then takes one batched step (which also runs one prefill pass
for the jobs waiting to join), until none is left. A command that cannot join (loading a model, media, speculative decoding)
waits until the batch has drained, and what arrives after it waits behind it, so commands
still take effect in arrival order. Two requests on one session at once do not share its
cache: the later one decodes on a private session, dropped when it ends.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.api import (
    Cancel,
    Command,
    Complete,
    Decide,
    DoneEvent,
    DropSession,
    Embed,
    EngineStatus,
    ErrorEvent,
    Event,
    Generate,
    GenerationResult,
    GetModelInfo,
    InspectModel,
    LoadDraftModel,
    LoadEmbedder,
    LoadModel,
    MemoryEvent,
    MountAdapter,
    ProgressEvent,
    RestoreSession,
    SaveSession,
    ScorePrompt,
    SessionRestore,
    SetActiveAdapters,
    TokenEvent,
    Train,
    Transcribe,
    UnloadModel,
    UnmountAdapter,
)
from engine.errors import EngineError, OutOfMemoryBudget, WrongModelKind
from engine.runtime.host import ModelHost, token_event
from engine.runtime.shard_worker import NOT_MINE, ShardRouter

MEMORY_INTERVAL_S = 0.5
_STOP = object()


@dataclass
class _Job:
    """A generation decoding in the batch."""

    rid: int
    stream: Iterator[Any]
    session_id: str
    private: bool  # its session is its own, dropped when it ends
    result: GenerationResult | None = None


def one_line(exc: BaseException) -> str:
    """A readable single line for any exception (no Python class names)."""
    from engine.runtime.readable import readable

    return readable(exc)


class EngineWorker:
    def __init__(
        self,
        on_event: Callable[[Event], None],
        host: ModelHost | None = None,
        *,
        whisper_path: str | None = None,
    ) -> None:
        self._on_event = on_event
        self._host = host or ModelHost()
        self._embedder: ModelHost | None = None  # a sentence embedding model beside it, for documents
        # The Whisper model Transcribe uses when the command names none.
        self.whisper_path = whisper_path
        self._queue: queue.Queue[Any] = queue.Queue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._cancels: dict[int, threading.Event] = {}
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._budget = 0
        self._status = EngineStatus()
        self._jobs: dict[int, _Job] = {}  # generations decoding in the batch, by request id
        self._held: Any = None  # a command waiting for the batch to drain
        self._memory_at = 0.0
        # A model split across machines; a lost split's memory figures (no ranks) go out at once.
        self._shards = ShardRouter(self._host, self._emit, lambda: self._emit_memory())

    # ---- caller side (any thread) -------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._thread.start()

    def submit(self, command: Command) -> int:
        """Queue ``command``; returns its request id. Thread-safe."""
        with self._lock:
            rid = next(self._ids)
            if isinstance(command, Cancel):
                target = self._cancels.get(command.target)
                if target is not None:
                    target.set()
            else:
                self._cancels[rid] = threading.Event()
        if isinstance(command, Cancel):
            self._emit(DoneEvent(rid, None))
            return rid
        if self._dead is not None:
            self._finish_error(rid, f"The engine stopped earlier ({self._dead}); restart the app.", "Fatal")
            return rid
        self._queue.put((rid, command))
        return rid

    def shutdown(self, timeout: float | None = 5.0) -> bool:
        """Cancel everything, stop the thread; True when it ended within ``timeout``."""
        with self._lock:
            for ev in self._cancels.values():
                ev.set()
        self._queue.put(_STOP)
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def status(self) -> EngineStatus:
        """The frozen status the worker thread published last (one reference read: safe
        from any thread)."""
        return self._status

    @property
    def dead(self) -> str | None:
        """Why the worker's loop stopped for good (every later command is refused), or None."""
        return self._dead

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def host(self) -> ModelHost:
        """The ModelHost this worker drives. Other threads may read its settings (template,
        tokenizer, generation defaults); all MLX work goes through ``submit``. A model split
        across machines: its text side here (shard_front.py)."""
        return self._shards.front or self._host

    # ---- worker side ----------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken listener must not take the engine down
            pass

    def _finish_error(self, rid: int, message: str, kind: str = "EngineError") -> None:
        with self._lock:
            self._cancels.pop(rid, None)
        self._emit(ErrorEvent(rid, message, kind))
        if kind == "ExpertFileChanged" and self._host.loaded:
            # Experts streamed from a file that changed or vanished: nothing more can be read
            # from it, so the model goes (its reply keeps the text it had).
            self._host.unload()
            self._publish_status()
            self._emit_memory()

    def _next_command(self) -> Any:
        """The next command to take in, or None when the batch should step first."""
        if self._jobs:
            if self._held is not None:
                return None
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                return None
        if self._held is not None:
            item, self._held = self._held, None
            return item
        return self._queue.get()

    def _run(self) -> None:
        rid = 0
        try:
            while True:
                item = self._next_command()
                if item is _STOP:
                    self._shards.close()  # no rank outlives the engine
                    while self._jobs:  # shutdown set their cancel flags: they end at once
                        self._round()
                    if self._held is not None:
                        self._finish_error(self._held[0], "The engine was shut down.")
                    return
                if item is None:
                    self._round()
                    continue
                rid, command = item
                with self._lock:
                    cancel = self._cancels.get(rid) or threading.Event()
                if self._start_job(rid, command, cancel):
                    rid = 0
                    continue
                # A decision uses caches of its own: it runs between the batch's steps.
                if self._jobs and not isinstance(command, DropSession | GetModelInfo | Decide):
                    self._held, rid = item, 0  # runs once the batch has drained
                    continue
                try:
                    result = self._handle(rid, command, cancel)
                except Exception as exc:  # noqa: BLE001 - every failure ends only its request
                    kind = type(exc).__name__ if isinstance(exc, EngineError) else "InternalError"
                    self._publish_status()
                    self._finish_error(rid, one_line(exc), kind)
                    continue
                self._publish_status()
                with self._lock:
                    self._cancels.pop(rid, None)
                self._emit(DoneEvent(rid, result))
                rid = 0
        except BaseException as exc:  # the loop itself died: nobody waits forever
            self._dead = one_line(exc)
            self._shards.close()
            if rid:
                self._finish_error(rid, f"The engine stopped: {self._dead}", "Fatal")
            waiting = [*self._jobs, *([self._held[0]] if self._held is not None else [])]
            self._jobs, self._held = {}, None
            for job_rid in waiting:
                self._finish_error(job_rid, f"The engine stopped: {self._dead}", "Fatal")
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    self._finish_error(item[0], f"The engine stopped: {self._dead}", "Fatal")
            raise

    # ---- the batch ------------------------------------------------------------------

    def _start_job(self, rid: int, command: Command, cancel: threading.Event) -> bool:
        """Put a generation into the batch; False when it must run on its own."""
        host = self._host
        if not isinstance(command, Generate | Complete) or not host.loaded or command.params.speculative:
            return False
        if command.params.context_policy == "rolling":  # its window may slide mid-reply: on its own
            return False
        if isinstance(command, Generate):
            from engine.media.parts import media_kinds

            try:
                if media_kinds(command.messages, command.media):
                    return False
            except Exception:  # noqa: BLE001 - malformed parts: the plain path says what is wrong
                return False
        try:
            batch = host.batch
        except Exception:  # noqa: BLE001 - a model the batch cannot take runs (or is refused) on its own
            return False
        if batch is None:
            return False
        sid, private = command.session_id, False
        if any(job.session_id == sid for job in self._jobs.values()):
            sid, private = f"{sid}\x1fbatch-{rid}", True
        try:
            stream = host.open_request(command, self._emit, cancel, request_id=rid, session_id=sid, batch=batch)
        except Exception as exc:  # noqa: BLE001 - refused before it started: ends only this request
            if private:
                host.drop_session(sid)
            kind = type(exc).__name__ if isinstance(exc, EngineError) else "InternalError"
            self._finish_error(rid, one_line(exc), kind)
            return True
        self._jobs[rid] = _Job(rid, stream, sid, private)
        self._publish_status()
        return True

    def _round(self) -> None:
        """Each job takes what the batch has for it (or its next prefill chunk), then the
        batch takes one step."""
        from engine.decode.loop import WAITING

        for job in list(self._jobs.values()):
            try:
                for item in job.stream:
                    if item is WAITING:
                        break
                    if isinstance(item, GenerationResult):
                        job.result = item
                    else:
                        self._emit(token_event(item, job.rid))
                else:
                    self._end_job(job)
            except Exception as exc:  # noqa: BLE001 - ends only this request
                self._end_job(job, exc)
        if not self._host.loaded or self._host.batch is None:
            return
        batch = self._host.batch
        try:
            batch.step()
        except Exception as exc:  # noqa: BLE001 - a failed step ends every sequence in it
            batch.reset()
            for job in list(self._jobs.values()):
                try:
                    job.stream.throw(exc)  # its session drops the cache it can no longer trust
                except BaseException as raised:  # noqa: BLE001
                    self._end_job(job, raised if isinstance(raised, Exception) else exc)
                else:
                    job.stream.close()
                    self._end_job(job, exc)
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_INTERVAL_S:
            self._memory_at = now
            self._emit_memory()

    def _end_job(self, job: _Job, error: Exception | None = None) -> None:
        self._jobs.pop(job.rid, None)
        if job.private:
            self._host.drop_session(job.session_id)
        self._publish_status()
        if error is None and job.result is None:
            error = EngineError("generation ended without a result")
        if error is not None:
            kind = type(error).__name__ if isinstance(error, EngineError) else "InternalError"
            self._finish_error(job.rid, one_line(error), kind)
            return
        self._emit_memory()
        with self._lock:
            self._cancels.pop(job.rid, None)
        self._emit(DoneEvent(job.rid, job.result))

    def _publish_status(self) -> None:
        host = self._host
        self._status = EngineStatus(
            model_loaded=bool(host.loaded) or self._shards.loaded,
            tower_loaded=bool(host.tower_loaded),
            decoding=len(self._jobs),
            budget_bytes=self._budget if host.loaded else 0,
            kv_allowance_bytes=self._kv_allowance(),
        )

    def _kv_allowance(self) -> int:
        """What the budget leaves for KV caches beside the weights (0: no budget)."""
        if not self._host.loaded or not self._budget:
            return 0
        beside = self._embedder.weights_bytes() if self._embedder is not None and self._embedder.loaded else 0
        return max(0, self._budget - self._host.weights_bytes() - beside)

    def _handle(self, rid: int, command: Command, cancel: threading.Event) -> Any:
        host = self._host
        routed = self._shards.handle(rid, command, cancel)
        if routed is not NOT_MINE:
            self._emit_memory()
            return routed
        if isinstance(command, LoadModel):
            info = host.load(
                command.path,
                budget=command.memory_budget,
                kv_bits=command.kv_bits,
                kv_group_size=command.kv_group_size,
                context_cap=command.context_cap,
                resident_experts=command.resident_experts,
                paged_kv_block_size=command.paged_kv_block_size,
                paged_kv_where_possible=command.paged_kv_where_possible,
                progress=lambda done, total, message="": self._emit(
                    ProgressEvent(rid, "load", float(done), float(total), message)
                ),
                cancel=cancel,
            )
            self._budget = info.plan.budget_bytes if info.plan is not None else 0
            self._emit_memory()
            return info
        if isinstance(command, UnloadModel):
            host.unload()
            self._emit_memory()
            return None
        if isinstance(command, InspectModel):
            from engine.runtime.model_info import inspect_model

            return inspect_model(command.path)
        if isinstance(command, DropSession):
            host.drop_session(command.session_id)
            return None
        if isinstance(command, Generate | Complete):
            return self._generate(rid, command, cancel)
        if isinstance(command, SaveSession):
            return host.save_session(command.session_id, command.path)
        if isinstance(command, RestoreSession):
            tokens, reason = host.restore_session(command.session_id, command.path)
            return SessionRestore(tokens, reason)
        if isinstance(command, GetModelInfo):
            return host.info if host.loaded else None
        if isinstance(command, MountAdapter):
            return host.mount_adapter(command.path, command.name)
        if isinstance(command, SetActiveAdapters):
            host.set_active_adapters(command.scales)
            return host.info
        if isinstance(command, UnmountAdapter):
            host.unmount_adapter(command.name)
            return host.info
        if isinstance(command, LoadDraftModel):
            info = host.load_draft(
                command.path,
                progress=lambda done, total, message="": self._emit(
                    ProgressEvent(rid, "load", float(done), float(total), message)
                ),
                cancel=cancel,
            )
            self._emit_memory()
            return info
        if isinstance(command, Transcribe):
            return self._transcribe(rid, command, cancel)
        if isinstance(command, ScorePrompt):
            prompt = command.prompt
            ids = host.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
            return host.score_prompt(ids, command.top_logprobs, cancel)
        if isinstance(command, Decide):
            from engine.runtime.decide import decide

            return decide(host, command, cancel)
        if isinstance(command, Train):
            from engine.runtime.train_job import run_train

            result = run_train(host, command, rid, cancel, self._emit)
            self._emit_memory()
            return result
        if isinstance(command, LoadEmbedder):
            return self._load_embedder(rid, command, cancel)
        if isinstance(command, Embed):
            if command.beside and (self._embedder is None or not self._embedder.loaded):
                raise EngineError("No embedding model is loaded beside the chat model: pick one first.")
            result = (self._embedder if command.beside else host).embed(command.inputs, cancel)
            self._emit_memory()
            return result
        raise EngineError(f"Unknown command {type(command).__name__}.")

    def _load_embedder(self, rid: int, command: LoadEmbedder, cancel: threading.Event) -> Any:
        """An embedding model beside the chat model, in what the chat model's budget leaves."""
        if self._embedder is not None:
            self._embedder.unload()
            self._embedder = None
        if command.path is None:
            self._emit_memory()
            return None
        embedder = ModelHost()
        left = self._kv_allowance() or None
        try:
            info = embedder.load(
                command.path,
                budget=left,
                progress=lambda done, total, message="": self._emit(
                    ProgressEvent(rid, "load", float(done), float(total), message)
                ),
                cancel=cancel,
            )
        except OutOfMemoryBudget as exc:
            from engine.runtime.memory import format_bytes

            need = str(exc).split(";")[0]  # "<name> needs <size> for its weights"
            raise OutOfMemoryBudget(
                f"{need}, and beside {self._host.info.name} the memory budget has {format_bytes(left or 0)} left: "
                "pick a smaller embedding model, unload the chat model, or raise the budget."
            ) from None
        if info.embedding_dimensions is None:
            embedder.unload()
            raise WrongModelKind(
                f"{info.name} is a chat model, not a sentence embedding model; pick an embedding model."
            )
        self._embedder = embedder
        self._emit_memory()
        return info

    def _generate(self, rid: int, command: Generate | Complete, cancel: threading.Event) -> Any:
        last = [time.monotonic()]

        def on_event(event: Event) -> None:
            self._emit(event)
            if isinstance(event, TokenEvent | ProgressEvent):
                now = time.monotonic()
                if now - last[0] >= MEMORY_INTERVAL_S:
                    last[0] = now
                    self._emit_memory()

        result = self._host.run_request(command, on_event, cancel, request_id=rid)
        self._emit_memory()
        return result

    def _transcribe(self, rid: int, command: Transcribe, cancel: threading.Event) -> Any:
        import os

        from engine.media.audio import load_audio
        from engine.media.mel import WHISPER_SAMPLE_RATE
        from engine.media.whisper.transcribe import WHISPER_ENV, NoWhisperModel, no_whisper_message

        model_path = command.model_path or self.whisper_path or os.environ.get(WHISPER_ENV)
        if not model_path:
            raise NoWhisperModel(no_whisper_message("No Whisper model is set for transcription"))
        # Decode first: an unreadable file is refused before any model loads.
        samples = load_audio(command.path, WHISPER_SAMPLE_RATE)
        transcriber = self._host.transcriber(
            model_path,
            progress=lambda done, total, message="": self._emit(
                ProgressEvent(rid, "load", float(done), float(total), message)
            ),
        )
        if transcriber.settings.sample_rate != WHISPER_SAMPLE_RATE:
            samples = load_audio(command.path, transcriber.settings.sample_rate)
        result = transcriber.transcribe(
            samples,
            language=command.language,
            cancel=cancel,
            on_window=lambda done, total: self._emit(
                ProgressEvent(rid, "transcribe", float(done), float(total), f"window {done} of {total}")
            ),
        )
        self._emit_memory()
        return result

    def _emit_memory(self) -> None:
        from engine.runtime.expert_plan import expert_store
        from engine.runtime.memory import live_memory, total_memory

        live = live_memory()
        weights = self._host.weights_bytes()
        store = expert_store(self._host.model) if self._host.loaded else None
        self._emit(
            MemoryEvent(
                active_bytes=live["active"],
                cache_bytes=live["cache"],
                peak_bytes=live["peak"],
                weights_bytes=weights,
                kv_bytes=self._host.kv_bytes(),
                budget_bytes=self._budget,
                total_bytes=total_memory(),
                kv_allowance_bytes=self._kv_allowance(),
                expert_slab_bytes=store.slab_bytes if store is not None else 0,
                expert_hit_rate=store.stats.hit_rate if store is not None else 1.0,
                ranks=self._shards.ranks(),
                kv_pool=self._host.kv_pool_stats() if self._host.loaded else None,
            )
        )
