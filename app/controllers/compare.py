"""Compare: one prompt answered twice, streamed into two columns, one answer kept as the
chat's reply: the loaded model with two adapter sets (one may be none), or the loaded
model against another model.

The two runs share the engine's one thread, so the second column waits for the first
(its header says so) and runs after it. The engine holds one chat model, so a second
model is loaded for its column and the chat's model loaded back afterwards (``load``,
the window's own loading, which remounts its adapters). Each run has a session of its own, dropped
afterwards, so neither touches the chat's cache; the chat's adapter choice is put back
when both are done. The chat's documents go in as they do for a normal reply. Keeping a
column adds the question and that answer to the chat, stats and adapters included. No
widgets here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable, RequestEvents
from app.controllers.chat import ChatController
from app.controllers.choices import build_params
from app.qt import QObject, Signal, emit
from engine.documents.retrieval import cards


def variant_name(scales: dict[str, float]) -> str:
    return ", ".join(f"{n} ×{s:g}" for n, s in sorted(scales.items())) or "no adapter"


class CompareController(QObject):
    header = Signal(int, str)  # column, its header
    token = Signal(int, str)  # column, answer text
    column_done = Signal(int, str, dict)  # column, final text, stats
    finished = Signal()
    failed = Signal(str)

    def __init__(
        self,
        chat: ChatController,
        bridge: EngineBridge,
        load: Callable[[str], Awaitable[bool]] | None = None,
        parent: QObject | None = None,
    ):
        super().__init__(parent)
        self.chat, self.bridge, self.load = chat, bridge, load
        self.models: list[str | None] = [None, None]  # a column's model path; None: the loaded one
        self.question = ""
        self.variants: list[dict[str, float]] = []
        self.results: list[tuple[str, dict[str, Any]]] = []
        self.running = False

    def default_variants(self) -> list[dict[str, float]]:
        """The chat's adapters (or every mounted one at ×1) against none."""
        info = self.bridge.model_info
        mounted = [a.name for a in info.adapters] if info is not None else []
        conv = self.chat.store.conversation(self.chat.conversation_id) if self.chat.conversation_id else None
        chosen = {n: s for n, s in (conv.adapters if conv else {}).items() if n in mounted and s}
        return [chosen or {n: 1.0 for n in mounted}, {}]

    async def run(
        self, question: str, variants: list[dict[str, float]] | None = None, other_model: str | None = None
    ) -> bool:
        info = self.bridge.model_info
        if info is None:
            emit(self.failed, "Load a model first: Compare answers with it twice.")
            return False
        if other_model is not None:
            variants = variants or [dict(info.active_adapters or {}), {}]
            self.models = [None, other_model]
        else:
            variants = variants or self.default_variants()
            self.models = [None, None]
        if variants[0] == variants[1] and other_model is None:
            emit(self.failed, "Mount an adapter first (Adapters menu): Compare runs with and without it.")
            return False
        if self.running or self.chat.busy:
            emit(self.failed, "Wait for the reply to finish before comparing.")
            return False
        self.running, self.question, self.variants, self.results = True, question.strip(), variants, []
        cid = self.chat.conversation_id
        conv = self.chat.store.conversation(cid) if cid is not None else None
        messages = [{"role": m.role, "content": m.content} for m in (self.chat.store.thread(cid) if cid else [])]
        messages.append({"role": "user", "content": self.question})
        sources = None
        if self.chat.documents is not None and cid is not None:
            sources = await self.chat.documents.context(cid, self.question, info.context_length)
            if sources is not None and sources.text:
                messages[-1]["content"] = f"{sources.text}\n\nQuestion: {self.question}"
        params = build_params(conv.settings if conv else {}, info.generation_defaults or {})
        home = info.path
        names = [self._column_name(col, variants[col], info.name) for col in range(2)]
        emit(self.header, 0, names[0])
        emit(self.header, 1, f"{names[1]} (waits, then runs after the first)")
        try:
            for col, scales in enumerate(variants):
                model = self.models[col]
                if model is not None:
                    if self.load is None or not await self.load(model):
                        emit(self.failed, f"Compare stopped: {names[col]} did not load.")
                        return False
                await self.bridge.set_active_adapters(scales)
                emit(self.header, col, names[col])
                # This column's run alone streams here (the bridge routes each request's events).
                events = RequestEvents(token=self._column_tokens(col))
                result = await self.bridge.generate(f"compare-{col}", messages, params, events=events)
                stats = asdict(result.stats)
                if sources is not None:
                    stats["sources"] = cards(sources, result.text)
                self.results.append((result.text, stats))
                emit(self.column_done, col, result.text, stats)
                self.bridge.drop_session(f"compare-{col}")
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, f"Compare stopped: {exc}")
            return False
        finally:
            self.running = False
            if any(self.models) and self.load is not None:  # the chat's own model back
                await self.load(home)
            if conv is not None:
                await self.chat.apply_adapter_choice(conv.adapters)
            else:
                await self.bridge.set_active_adapters({})
        emit(self.finished)
        return True

    def _column_name(self, col: int, scales: dict[str, float], loaded: str) -> str:
        other = self.models[col]
        model = Path(other).name if other else loaded
        if not any(self.models):
            return variant_name(scales)
        return f"{model}, {variant_name(scales)}" if scales else model

    def keep(self, column: int) -> int | None:
        """The question and this column's answer become the chat's next turn; the reply's id."""
        if column >= len(self.results):
            return None
        text, stats = self.results[column]
        store = self.chat.store
        if self.chat.conversation_id is None:
            self.chat.conversation_id = store.create_conversation()
        conv = store.conversation(self.chat.conversation_id)
        if conv is None:
            return None  # the chat was deleted while the columns streamed
        user_id = store.add_message(conv.id, "user", self.question, conv.leaf_id)
        info = self.bridge.model_info
        reply_id = store.add_message(
            conv.id,
            "assistant",
            text,
            user_id,
            status="complete",
            model=Path(other).name if (other := self.models[column]) else (info.name if info else ""),
            adapters=self.variants[column],
        )
        store.update_message(reply_id, stats=stats)
        self.chat.refresh()
        return reply_id

    def _column_tokens(self, column: int) -> Callable[[str, str], None]:
        """The answer's pieces of one column's run, to that column (its reasoning stays out)."""

        def on_token(text: str, channel: str) -> None:
            if channel == "answer":
                emit(self.token, column, text)

        return on_token
