"""ChatController: one conversation's flow between the store, the bridge and the view.

Order matters for crash safety: the user message is committed before the engine
is asked for anything, the assistant message exists (status "streaming") before
the first token, and its text is committed at least once a second while it grows.
The store commits on its own thread; this controller awaits the commits it depends on
(the GUI thread is free meanwhile) and lets the partial saves go without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

from app.attachments import NO_VIDEO, NO_VISION, keep_file
from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable, RequestEvents
from app.controllers import tool_turns
from app.controllers.choices import accepts_reasoning as accepts_reasoning  # importable from here, as before
from app.controllers.choices import build_params
from app.controllers.documents import DocumentsController
from app.controllers.thread import context_start, engine_messages, title_from
from app.controllers.tools import ToolCall, ToolError, ToolsController
from app.history_writer import StoreError
from app.ops import Op
from app.qt import QObject, QTimer, Signal, emit
from app.store import Conversation, HistoryStore, Message
from app.tasks import spawn
from engine import api
from engine.documents.retrieval import Context, cards

TRAINING = "An adapter is training on this model: wait for it (or Stop it in Adapters → Train…), then send."
MAX_TOOL_ROUNDS = 8  # calls and answers in one reply before the model must answer in words


class TranscriptView(Protocol):
    """What the controller drives of the chat transcript (app.ui.chat_view.ChatView)."""

    edit_submitted: Any  # Signal(message id, new text)
    regenerate_requested: Any  # Signal(message id)
    version_requested: Any  # Signal(message id, version)
    footer_source: Callable[[], str] | None
    widgets: dict[int, Any]

    def show_thread(self, messages: list[Message], versions: dict[int, tuple[int, int]]) -> None: ...
    def start_streaming(self, message: Message, versions: tuple[int, int] = (1, 1)) -> None: ...
    def append(self, text: str, channel: str) -> None: ...
    def set_draft(self, text: str, reasoning: str = "") -> None: ...
    def set_answer(self, text: str) -> None: ...
    def stop_streaming(self) -> None: ...
    def update_message(
        self,
        message_id: int,
        content: str,
        reasoning: str,
        stats: dict[str, Any],
        status: str,
        adapters: dict[str, float],
    ) -> None: ...
    def set_context_start(self, dropped: int, before_id: int | None) -> None: ...
    def set_busy(self, busy: bool) -> None: ...


SAVE_INTERVAL_MS = 500
RETRY_SAVE_MS = 5000  # a final save that failed (full disk) is tried again this often

# Chats whose engine sessions (prompt ids and KV caches) stay loaded; older ones are freed
# when another chat is opened, and come back from their saved cache file on their next turn.
LIVE_SESSIONS = 4


class ChatController(QObject):
    busy_changed = Signal(bool)
    status = Signal(str)  # a readable line for the status bar
    failed = Signal(str)  # a readable line worth a dialog
    reply_finished = Signal(int, object)  # assistant message id, GenerationResult | None
    conversations_changed = Signal()

    def __init__(self, store: HistoryStore, bridge: EngineBridge, view: TranscriptView, parent: QObject | None = None):
        super().__init__(parent)
        self.store, self.bridge, self.view = store, bridge, view
        self.conversation_id: int | None = None
        self.reply_id: int | None = None  # the assistant message being streamed
        self._waiting: asyncio.Future[api.ModelInfo | None] | None = None  # a send waiting for the model to load
        self._keeping = False  # a send copying its attachments into the data folder
        self.plain_tps: dict[str, float] = {}  # model path -> last plain decoding speed
        self._answer = ""
        self._reasoning = ""
        self._rounds: list[dict[str, Any]] = []  # the reply's tool rounds (app.controllers.tool_turns)
        self._saved_len = (0, 0)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self._save_partial)
        # Replies whose final save failed: message id -> the fields still to write.
        self._unsaved: dict[int, dict[str, Any]] = {}
        self._retry_timer = QTimer(self)
        self._retry_timer.setInterval(RETRY_SAVE_MS)
        self._retry_timer.timeout.connect(self._retry_saves)
        # The reply's own events (each generate call routes only its request's here).
        self._events = RequestEvents(token=self._on_token, draft=self._on_draft, progress=self._on_progress)
        self._reading = ""  # weights read before the reply starts (the MTP layer), and how far
        view.edit_submitted.connect(self._edit_slot)
        view.regenerate_requested.connect(self._regenerate_slot)
        view.version_requested.connect(self.switch_version)
        view.footer_source = self._live_footer
        self._started = 0.0
        self.tools: ToolsController | None = None  # MCP tools offered to the model, if any
        self.documents: DocumentsController | None = None  # the chats' dropped documents
        # Stop pressed during this reply: honoured where no generation runs to cancel, before
        # the first one (its placeholder still committing, the saved cache being read) and
        # between tool rounds.
        self._stopped = False
        self.caches: Any = None  # SavedCaches: each conversation's KV cache kept between runs
        self._recent: list[int] = []  # opened chats, most recent last (LIVE_SESSIONS of them)

    @property
    def busy(self) -> bool:
        return self.reply_id is not None or self._waiting is not None or self._keeping

    # ---- showing a conversation ---------------------------------------------------------

    def open(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id
        self._free_old_sessions(conversation_id)
        self.refresh()

    def _free_old_sessions(self, conversation_id: int | None) -> None:
        """Keep the engine sessions of the last LIVE_SESSIONS chats opened; free the older
        ones whose cache is saved (a chat whose save is still due keeps its session)."""
        if conversation_id is None:
            return
        if conversation_id in self._recent:
            self._recent.remove(conversation_id)
        self._recent.append(conversation_id)
        for old in self._recent[:-LIVE_SESSIONS]:
            if self.caches is not None and self.caches.is_unsaved(old):
                continue
            self._recent.remove(old)
            self.bridge.drop_session(old)

    def refresh(self) -> None:
        if self.conversation_id is None:
            self.view.show_thread([], {})
            return
        thread = self.store.thread(self.conversation_id)
        self.view.show_thread(thread, self._versions(thread))
        # Where the model's memory began at the latest reply, when turns were left out.
        last = next((m for m in reversed(thread) if m.role == "assistant"), None)
        if last is not None and last.stats.get("context_start") is not None:
            self.view.set_context_start(last.stats.get("dropped_messages", 0), last.stats["context_start"])

    def _conversation(self, conversation_id: int | None) -> Conversation:
        """The conversation this controller made or opened (it is in the history)."""
        conv = self.store.conversation(conversation_id) if conversation_id is not None else None
        if conv is None:
            raise LookupError(f"Conversation {conversation_id} is not in the history.")
        return conv

    def _versions(self, thread: list[Message]) -> dict[int, tuple[int, int]]:
        if not thread or self.conversation_id is None:
            return {}
        return self.store.versions(self.conversation_id, thread)

    def context_tokens(self) -> int:
        """Tokens the conversation's prompt holds now: the last reply's counted prompt and
        output, plus an estimate (~4 characters a token) for anything written after it."""
        if self.conversation_id is None:
            return 0
        total = 0
        for m in self.store.thread(self.conversation_id):
            counted = m.stats.get("prompt_tokens", 0) + m.stats.get("generated_tokens", 0)
            total = counted if m.role == "assistant" and counted else total + len(m.content) // 4 + 4
        return total

    def switch_version(self, message_id: int, delta: int) -> None:
        if self.busy:
            emit(self.status, "Stop the reply before switching versions.")
            return
        sibs = self.store.siblings(message_id)
        i = sibs.index(message_id) + delta
        if 0 <= i < len(sibs):
            self.store.show_version(sibs[i])
            self.refresh()

    # ---- the three ways a reply starts --------------------------------------------------

    async def send(self, text: str, attachments: list[tuple[str, str]] | None = None) -> bool:
        """Save the user message (attachments copied into the data dir first), then ask
        for a reply. Returns False when nothing was sent (the reason went to ``failed``)."""
        text = text.strip()
        attachments = list(attachments or [])
        if not (text or attachments) or self.busy:
            return False
        if getattr(self.bridge, "active_training", None) is not None:  # the model is busy learning
            emit(self.failed, TRAINING)
            return False
        info = self.bridge.model_info
        if any(kind == "image" for kind, _ in attachments) and info is not None and not info.vision:
            emit(self.failed, NO_VISION)
            return False
        if any(kind == "video" for kind, _ in attachments) and info is not None and not info.video:
            emit(self.failed, NO_VIDEO)
            return False

        def keep_all() -> list[tuple[str, str]]:
            return [(kind, str(keep_file(self.store.data_dir, path))) for kind, path in attachments]

        # Hashing and copying a large recording or photo would stall the window.
        self._keeping = True
        try:
            kept = await Op(keep_all) if attachments else []
        except OSError as exc:
            emit(
                self.failed,
                f"Could not keep the attachment {Path(exc.filename or '').name}: "
                f"{exc.strerror or exc}. Attach it again.",
            )
            return False
        finally:
            self._keeping = False
        if self.conversation_id is None:
            self.conversation_id = self.store.create_conversation()
            self._free_old_sessions(self.conversation_id)
        conv = self._conversation(self.conversation_id)
        if conv.leaf_id is None:  # its first message (no need to read the thread)
            self.store.rename_conversation(conv.id, title_from(text, kept))
            emit(self.conversations_changed)
        user_id = self.store.add_message(conv.id, "user", text, conv.leaf_id, attachments=kept)
        try:
            await Op.of_future(self.store.last_write)
        except StoreError as exc:  # the message is not sent unsaved; the composer keeps it
            self.store.take_back(user_id)
            emit(self.failed, f"{exc} Your message was not sent; it is still in the box.")
            return False
        self.refresh()
        await self._reply(user_id)
        return True

    async def regenerate(self, assistant_id: int) -> None:
        msg = self.store.message(assistant_id)
        if msg is None or self.busy or msg.parent_id is None:
            return
        # The new version takes the old one's place on screen (‹ › brings it back), not a
        # place below it: show the thread up to the question before the reply starts.
        thread = self.store.thread(msg.conversation_id)
        cut = next((i for i, m in enumerate(thread) if m.id == msg.parent_id), len(thread) - 1)
        self.view.show_thread(thread[: cut + 1], self._versions(thread[: cut + 1]))
        await self._reply(msg.parent_id)

    async def edit(self, user_id: int, text: str) -> None:
        """A new version of an earlier user message, then a fresh reply from there."""
        msg = self.store.message(user_id)
        if msg is None or self.busy:
            return
        new_id = self.store.add_message(
            msg.conversation_id, "user", text, msg.parent_id, attachments=self.store.attachments(user_id)
        )
        self.refresh()
        await self._reply(new_id)

    def stop(self) -> bool:
        if self._waiting is not None:  # stop waiting; the load itself carries on
            self._waiting.cancel()
            return True
        if self.reply_id is None:
            return False
        self._stopped = True
        if self.bridge.active_generation is not None:
            self.bridge.cancel(self.bridge.active_generation)
        return True

    # ---- streaming one reply -------------------------------------------------------------

    async def _reply(self, parent_id: int) -> None:
        conv = self._conversation(self.conversation_id)
        info = self.bridge.model_info
        if self.bridge.loading:
            info = await self._wait_for_model()
            if info is None:
                return
        if info is None:
            emit(self.failed, "Load a model first: click the model button at the top.")
            return
        history = [m for m in self.store.thread(conv.id)]
        cut = next(i for i, m in enumerate(history) if m.id == parent_id)
        messages = self._engine_messages(history[: cut + 1], info)
        if conv.system_prompt.strip():
            messages.insert(0, {"role": "system", "content": conv.system_prompt})
        offset = len(messages) - (cut + 1)  # where the thread starts among the request's messages
        sources = await self._read_documents(conv.id, messages, history[cut], info)
        params = build_params(conv.settings, info.generation_defaults or {}, info.reasoning_control)
        if params.speculative == "draft" and not info.draft_model:
            emit(
                self.status,
                "No draft model is loaded, so this reply decodes without one: "
                "choose one under Settings → Speculative decoding.",
            )
            params.speculative = None
        if params.speculative == "mtp" and not info.mtp:
            emit(
                self.status,
                "This reply decodes without MTP drafting: "
                + (info.mtp_note or "the model has no built-in MTP layers."),
            )
            params.speculative = None
        try:
            adapters = await self.apply_adapter_choice(conv.adapters)
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, f"Could not switch adapters: {exc}")
            return
        info = self.bridge.model_info or info
        tools = await self._offered_tools(info)
        if tools and conv.settings.get("tool_choice") == "required":  # the first answer must be a call
            params.tool_choice = "required"

        self.reply_id = self.store.add_message(
            conv.id,
            "assistant",
            "",
            parent_id,
            status="streaming",
            model=info.name,
            adapters=adapters,
        )
        self._stopped = False
        try:
            await Op.of_future(self.store.last_write)
        except StoreError as exc:
            self.store.take_back(self.reply_id)
            self.reply_id = None
            emit(self.failed, f"{exc} No reply was asked for.")
            return
        self._answer = self._reasoning = self._reading = ""
        self._rounds = []
        self._saved_len = (0, 0)
        reply = self.store.message(self.reply_id)
        assert reply is not None  # added just above, in memory at once
        sibs = self.store.siblings(self.reply_id)
        self.view.start_streaming(reply, (len(sibs), len(sibs)))
        self.view.set_busy(True)
        emit(self.busy_changed, True)
        self._save_timer.start()
        started = self._started = time.monotonic()
        result: api.GenerationResult | None = None
        status = "error"
        try:
            if self.caches is not None:
                self.caches.note_reply(conv.id)
                await self.caches.restore(conv.id)  # before this engine's first turn of the chat
            if self._stopped:  # Stop came before the generation could: none is asked for
                status = "cancelled"
            else:
                result = await self.bridge.generate(conv.id, messages, params, tools=tools, events=self._events)
                if tools:
                    result = await self._tool_rounds(conv.id, messages, params, tools, info, result)
                status = "cancelled" if result.finish_reason == "cancelled" else "complete"
                if result.finish_reason == "error":
                    status = "error"
                    emit(self.failed, result.error or "The reply failed.")
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, str(exc))
        finally:
            self._save_timer.stop()
            stats = asdict(result.stats) if result is not None else {}
            if result is not None:
                # The engine's final text wins over the sum of the pieces (stop strings trimmed).
                self._answer, self._reasoning = result.text, result.reasoning
                adapters = dict(result.adapters)
                self._note_speed(info.path, params.speculative, status, stats)
                if result.dropped_messages:
                    stats["dropped_messages"] = result.dropped_messages
                    start = context_start(history[: cut + 1], offset, result.kept_messages, self.reply_id)
                    if start is not None:
                        stats["context_start"] = start
                if result.context_full:
                    stats["context_full"] = True
            reply_id, self.reply_id = self.reply_id, None
            if sources is not None:
                stats["sources"] = cards(sources, self._answer)
            if result is not None and self.caches is not None:
                spawn(self.caches.save(conv.id))
            self._save(
                reply_id,
                content=self._answer,
                reasoning=self._reasoning,
                status=status,
                stats=stats,
                adapters=adapters,
                tool_turns=self._rounds,
            )
            self.view.stop_streaming()
            self.view.update_message(reply_id, self._answer, self._reasoning, stats, status, adapters)
            self.view.set_context_start(stats.get("dropped_messages", 0), stats.get("context_start"))
            self.view.set_busy(False)
            emit(self.busy_changed, False)
            if status == "complete" and stats:
                emit(self.status, f"{stats.get('generated_tokens', 0)} tokens in {time.monotonic() - started:.1f} s")
            elif status == "cancelled":
                emit(self.status, "Stopped.")
            if result is not None and result.notes and self._sent_media(parent_id):
                emit(self.status, " ".join(result.notes))  # a long video sampled, audio cut: said once
            emit(self.reply_finished, reply_id, result)

    # ---- documents --------------------------------------------------------------------------

    async def _read_documents(
        self, conversation_id: int, messages: list[dict[str, Any]], question: Message, info: api.ModelInfo
    ) -> Context | None:
        """The chat's documents (whole, or the chunks best matching it) before the question."""
        if self.documents is None or question.role != "user":
            return None
        ctx = await self.documents.context(conversation_id, question.content, info.context_length)
        if ctx is None or not ctx.text:
            return None
        content = messages[-1]["content"]
        if isinstance(content, str):
            messages[-1]["content"] = f"{ctx.text}\n\nQuestion: {content}"
        else:
            messages[-1]["content"] = [{"type": "text", "text": ctx.text + "\n\n"}, *content]
        return ctx

    # ---- MCP tools ---------------------------------------------------------------------------

    async def _offered_tools(self, info: api.ModelInfo) -> list[dict[str, Any]] | None:
        """The MCP servers' tools, when some are set up and the model's template writes calls
        in a format the parser knows."""
        if self.tools is None or not self.tools.enabled:
            return None
        if info.tool_format is None:
            emit(
                self.status,
                f"{info.name}'s chat template does not describe tool calls, so this reply has no MCP tools.",
            )
            return None
        return await self.tools.offered() or None

    async def _tool_rounds(
        self,
        conv_id: int,
        messages: list[dict[str, Any]],
        params: api.GenerationParams,
        tools: list[dict[str, Any]],
        info: api.ModelInfo,
        result: api.GenerationResult,
    ) -> api.GenerationResult:
        """While the reply calls tools: show each call, ask (unless always allowed), run it,
        hand the result back as a tool message, and let the model go on. The calls are kept
        as the reply's tool rounds (saved as they go); the transcript shows their record
        in place of the raw markers."""
        assert self.tools is not None
        rounds = self._rounds
        for _ in range(MAX_TOOL_ROUNDS):
            if result.finish_reason not in ("stop", "length"):
                break
            text, calls = result.text, result.tool_calls  # the engine's tool-call channel
            if not calls:
                break
            turn = tool_turns.new_round(text, [(c.id, c.name, c.arguments) for c in calls])
            rounds.append(turn)
            for entry in turn["calls"]:
                call = ToolCall(entry["id"], entry["name"], entry["arguments"])
                self._show_rounds()
                decision = entry["decision"] = await self.tools.decide(call)
                if decision == "deny":
                    tool_turns.settle(entry, tool_turns.DENIED, tool_turns.DECLINED, "declined")
                else:
                    entry["state"] = tool_turns.RUNNING
                    self._show_rounds()
                    try:
                        tool_turns.settle(entry, tool_turns.DONE, await self.tools.call(call))
                    except ToolError as exc:
                        tool_turns.settle(entry, tool_turns.FAILED, f"Error: {exc}", f"⚠ {exc}")
                        emit(self.status, str(exc))
                self._show_rounds()
            messages += tool_turns.engine_messages("", [turn], info.tool_arguments_as_text)
            params.tool_choice = "auto"  # a forced call is forced once; the answer is the model's
            if self._stopped:
                result = replace(result, text="", finish_reason="cancelled")
                break
            result = await self.bridge.generate(conv_id, messages, params, tools=tools, events=self._events)
        if rounds:
            result = replace(result, text=tool_turns.record(rounds) + result.text)
        return result

    def _sent_media(self, message_id: int) -> bool:
        """Whether the message answered carries media (its notes are news only once)."""
        return bool(self.store.attachments(message_id))

    def _show_rounds(self) -> None:
        """Show the calls as they stand and save them (a crash keeps what ran)."""
        self._answer = tool_turns.record(self._rounds)
        self.view.set_answer(self._answer)
        if self.reply_id is not None:  # a failure is told by the store; the final save tries again
            self.store.update_message(self.reply_id, content=self._answer, tool_turns=self._rounds)

    def _engine_messages(self, history: list[Message], info: api.ModelInfo) -> list[dict[str, Any]]:
        messages, notes = engine_messages(history, info)
        for note in notes:
            emit(self.status, note)
        return messages

    async def apply_adapter_choice(self, chosen: dict[str, float]) -> dict[str, float]:
        """Make the conversation's adapter choice the worker's active set (only adapters
        mounted on this model count). Returns the set the reply will run under."""
        info = self.bridge.model_info
        mounted = {a.name for a in info.adapters} if info is not None else set()
        wanted = {name: scale for name, scale in chosen.items() if name in mounted}
        if info is not None and mounted and wanted != info.active_adapters:
            info = await self.bridge.set_active_adapters(wanted)
        return wanted

    def _note_speed(self, model_path: str, speculative: str | None, status: str, stats: dict[str, Any]) -> None:
        """Plain replies set the model's baseline speed; speculative ones are compared to it."""
        tps = stats.get("generation_tps") or 0.0
        if status != "complete" or not tps or stats.get("generated_tokens", 0) < 2:
            return
        if speculative is None:
            self.plain_tps[model_path] = tps
        elif self.plain_tps.get(model_path):
            stats["speedup"] = round(tps / self.plain_tps[model_path], 3)
        if speculative is not None:
            stats["speculative"] = speculative

    async def _wait_for_model(self) -> api.ModelInfo | None:
        """A message sent while a model loads goes out once it has loaded."""
        self._waiting = asyncio.ensure_future(self.bridge.wait_for_load())
        self.view.set_busy(True)
        emit(self.busy_changed, True)
        emit(self.status, "Waiting for the model to finish loading…")
        try:
            info = await self._waiting
        except asyncio.CancelledError:
            emit(self.status, "Stopped waiting; the message is kept.")
            return None
        finally:
            self._waiting = None
            self.view.set_busy(False)
            emit(self.busy_changed, False)
        if info is None:
            emit(
                self.failed,
                "The model did not load, so the message was not answered. "
                "Pick a model, then press Regenerate or send again.",
            )
        return info

    def _live_footer(self) -> str:
        """Tokens, speed and time so far, for the message being streamed."""
        elapsed = time.monotonic() - self._started
        stats = self.bridge.live_stats(self.bridge.active_generation)
        if self._reading:
            return f"{self._reading}  ·  {elapsed:.1f} s"
        if stats is None or not stats.generated_tokens:
            return f"Reading the prompt…  {elapsed:.1f} s"
        parts = [f"{stats.generated_tokens} tokens"]
        if stats.generation_tps:
            parts.append(f"{stats.generation_tps:.1f} tok/s")
        parts.append(f"{elapsed:.1f} s")
        return "  ·  ".join(parts)

    def _on_token(self, text: str, channel: str) -> None:
        if self.reply_id is None:
            return
        if channel == "reasoning":
            self._reasoning += text
        else:
            self._answer += text
        self.view.append(text, channel)

    def _on_progress(self, stage: str, done: float, total: float, message: str) -> None:
        """Weights the engine reads before this reply can start (the built-in MTP layer, on the
        first reply that drafts with it): said once in the status bar, followed in the footer."""
        if self.reply_id is None or stage != "load":
            return
        if done == 0:
            emit(self.status, message)
        self._reading = f"{message} {100 * done / total:.0f}%" if 0 < total and done < total else ""

    def _on_draft(self, text: str, reasoning: str = "") -> None:
        # A diffusion block still refining: shown, never saved (only settled text is the reply).
        if self.reply_id is not None:
            self.view.set_draft(text, reasoning)

    def _save_partial(self) -> None:
        now = (len(self._answer), len(self._reasoning))
        if self.reply_id is not None and now != self._saved_len:
            self._saved_len = now
            written = self.store.update_message(self.reply_id, content=self._answer, reasoning=self._reasoning)
            Op.of_future(written).failure(self._partial_failed).run(self)

    def _partial_failed(self, exc: Exception) -> None:
        if not isinstance(exc, StoreError):
            raise exc
        self._saved_len = (-1, -1)  # tried again on the next tick; the reply streams on
        emit(self.status, str(exc))

    def _save(self, message_id: int, **fields: Any) -> None:
        """A reply's final save (in memory at once, so the history shows it); when it cannot
        land (full disk) the reply stays on screen and the save is tried again every few
        seconds until it does."""
        written = self.store.update_message(message_id, **fields)
        Op.of_future(written).success(lambda _: self._final_saved(message_id)).failure(
            lambda exc: self._final_failed(message_id, fields, exc)
        ).run(self)

    def _final_saved(self, message_id: int) -> None:
        if self._unsaved.pop(message_id, None) is not None:
            emit(self.status, "The chat history is saved again.")

    def _final_failed(self, message_id: int, fields: dict[str, Any], exc: Exception) -> None:
        if not isinstance(exc, StoreError):
            raise exc
        if message_id not in self._unsaved:
            emit(self.failed, f"{exc} The reply stays on screen and is saved as soon as it can be.")
        self._unsaved[message_id] = fields
        self._retry_timer.start()

    def _retry_saves(self) -> None:
        self._retry_timer.stop()  # each save starts it again should it fail
        for message_id, fields in list(self._unsaved.items()):
            self._save(message_id, **fields)

    def _edit_slot(self, message_id: int, text: str) -> None:
        spawn(self.edit(message_id, text))

    def _regenerate_slot(self, message_id: int) -> None:
        spawn(self.regenerate(message_id))
