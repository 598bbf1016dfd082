"""AdapterController: the open chat's LoRA adapters and the draft model, between the
store, the bridge and the menus that show them.

A chat keeps its own adapter choice (store); the loaded model keeps what is mounted
(engine). Mounted adapters are remembered per model by LoadSetup, which mounts them again
at the next load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable
from app.qt import QObject, Signal, emit
from app.store import HistoryStore


def fmt_adapters(scales: dict[str, float]) -> str:
    """``alpha ×1.0, beta ×0.5`` (empty for none)."""
    return ", ".join(f"{name} ×{scale:g}" for name, scale in scales.items())


class AdapterController(QObject):
    status = Signal(str)  # a readable line for the status bar
    failed = Signal(str)  # a readable line worth the banner
    shown = Signal(object, object, bool)  # mounted AdapterInfos, the chat's choice, model loaded
    draft_changed = Signal(object)  # the draft model's name, or None

    def __init__(
        self, store: HistoryStore, bridge: EngineBridge, chat: Any, load_setup: Any, parent: QObject | None = None
    ):
        super().__init__(parent)
        self.store, self.bridge, self.chat, self.load_setup = store, bridge, chat, load_setup

    def _conversation(self) -> Any:
        cid = self.chat.conversation_id
        return self.store.conversation(cid) if cid is not None else None

    def show(self) -> None:
        """Tell the menus what is mounted and what this chat chose."""
        info = self.bridge.model_info
        conv = self._conversation()
        mounted = list(info.adapters) if info is not None else []
        emit(self.shown, mounted, conv.adapters if conv is not None else {}, info is not None)

    async def apply(self) -> None:
        """Re-apply the open conversation's adapter choice to the loaded model."""
        conv = self._conversation()
        if conv is not None and self.bridge.model_info is not None and not self.chat.busy:
            try:
                await self.chat.apply_adapter_choice(conv.adapters)
            except (EngineRequestError, EngineUnavailable) as exc:
                emit(self.failed, f"Could not switch adapters: {exc}")
        self.show()

    async def choose(self, scales: dict[str, float]) -> None:
        """The Adapters menu changed: remember it for this conversation, apply it now."""
        if self.chat.conversation_id is None:
            return
        self.store.update_conversation(self.chat.conversation_id, adapters=dict(scales))
        if self.chat.busy:
            emit(self.status, "The adapters change from the next reply on.")
            return
        await self.apply()
        emit(self.status, f"Adapters: {fmt_adapters(scales)}" if scales else "Adapters off.")

    async def mount(self, path: str, name: str | None = None) -> bool:
        if self.bridge.model_info is None:
            emit(self.failed, "Load a model before mounting an adapter.")
            return False
        try:
            adapter = await self.bridge.mount_adapter(path, name)
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, f"Could not mount {Path(path).name}: {exc}")
            return False
        self.load_setup.remember(adapter)
        self.show()
        emit(
            self.status,
            f"Mounted {adapter.name} ({adapter.kind}, rank {adapter.rank}, "
            f"{adapter.targets} layers): tick it in the Adapters menu to use it.",
        )
        return True

    async def unmount(self, name: str) -> None:
        if self.chat.busy:
            emit(self.status, "Stop the reply before unmounting an adapter.")
            return
        try:
            await self.bridge.unmount_adapter(name)
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, f"Could not unmount {name}: {exc}")
            return
        self.load_setup.forget(name)
        self.show()
        emit(self.status, f"Unmounted {name}.")

    async def set_draft_model(self, path: str | None) -> bool:
        """Load (or, with None, unload) the draft model for speculative decoding."""
        if self.bridge.model_info is None:
            emit(self.failed, "Load a model before choosing a draft model.")
            return False
        try:
            draft = await self.bridge.load_draft_model(path)
        except (EngineRequestError, EngineUnavailable) as exc:
            reason = str(exc)
            if getattr(exc, "kind", "") == "OutOfMemoryBudget":
                reason = await self.load_setup.draft_refusal(path, reason)
            emit(self.failed, f"Could not use {Path(path or '').name} as the draft model: {reason}")
            return False
        emit(self.draft_changed, draft.name if draft is not None else None)
        emit(self.status, f"Draft model: {draft.name}" if draft is not None else "Draft model unloaded.")
        return True
