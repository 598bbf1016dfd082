"""ModelController: loading a model (and what goes with it) between the bridge and the window.

A load runs under the memory budget chosen in Settings; LoadSetup mounts the model's
remembered adapters as part of it and words a refusal against the budget. After a failed
load the engine may hold another model or none: the controller asks and says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable, RequestEvents
from app.memory_units import experts_note
from app.qt import QObject, Signal, emit
from app.tasks import spawn


class ModelController(QObject):
    status = Signal(str)
    failed = Signal(str)  # a readable line for the banner
    loading = Signal(str)  # the model's name: a load started
    load_ended = Signal()  # the load is over, whichever way
    loaded = Signal(object)  # ModelInfo: the window shows it
    ready = Signal(object)  # ModelInfo, once its adapters are applied too
    load_failed = Signal(str)  # the reason
    now_holding = Signal(object)  # after a failed load: the ModelInfo still loaded, or None
    progress = Signal(float, float, str)  # the load's: done, total, what it is reading

    def __init__(self, bridge: EngineBridge, load_setup: Any, adapters: Any, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge, self.load_setup, self.adapters = bridge, load_setup, adapters
        self.machines: Any = None  # app.controllers.machines: a model planned across machines
        self._split = False  # the engine reports ranks: a split model is loaded
        bridge.memory.connect(self._follow_split)

    async def load(self, path: str, memory_budget: int | None = None) -> bool:
        """Load ``path`` under ``memory_budget`` (default: the one chosen in Settings), then
        mount again the adapters it had and apply the open chat's choice."""
        name = Path(path).name
        if memory_budget is None:
            memory_budget = self.load_setup.budget_for_load()
        split = self.machines.split_for(path) if self.machines is not None else None
        across = {"hosts": split.hosts, "shard": split.shard} if split is not None else {}
        emit(self.loading, name)
        emit(self.status, f"Loading {name}" + (f" across {len(split.hosts)} machines…" if split else "…"))
        try:
            info = await self.bridge.load_model(
                path,
                memory_budget,
                prepare=self.load_setup.remount,
                kv_bits=self.load_setup.kv_bits_for_load(),
                context_cap=self.load_setup.context_cap_for_load(),
                paged_kv_block_size=self.load_setup.paged_block_size_for_load(),
                events=RequestEvents(
                    progress=lambda _stage, done, total, message: emit(self.progress, done, total, message)
                ),
                **across,
            )
        except (EngineRequestError, EngineUnavailable) as exc:
            reason = str(exc)
            if getattr(exc, "kind", "") == "OutOfMemoryBudget":
                reason = await self.load_setup.refusal(path, memory_budget, reason)
            emit(self.load_ended)
            await self._after_failed_load()
            emit(self.failed, f"Could not load {name}: {reason}")
            emit(self.load_failed, reason)
            return False
        emit(self.load_ended)
        self.load_setup.loaded(info, memory_budget)
        emit(self.loaded, info)
        await self.adapters.apply()
        mounted = [a.name for a in (self.bridge.model_info or info).adapters]
        loaded = f"Loaded {info.name}" + (f" with its adapters {', '.join(mounted)}." if mounted else ".")
        unshared = (
            f"Its chats keep their own context memory (not shared between chats): {info.paged_kv_declined}."
            if info.paged_kv_declined
            else ""
        )
        emit(self.status, " ".join(filter(None, (loaded, experts_note(info.plan), unshared))))
        if self.load_setup.skipped:
            emit(self.failed, self.load_setup.skipped)
        emit(self.ready, info)
        return True

    def _follow_split(self, figures: dict[str, Any]) -> None:
        """A split model whose ranks are gone outside a load (a rank was lost): the engine
        holds no model now, and the window says so."""
        if "ranks" not in figures:
            return
        had, self._split = self._split, bool(figures["ranks"])
        if had and not self._split and self.bridge.active_load is None and self.bridge.model_info is not None:
            spawn(self._after_failed_load())

    async def _after_failed_load(self) -> None:
        """A failed load may have replaced the model that was there: say what the engine holds now."""
        try:
            info = await self.bridge.refresh_model_info()
        except (EngineRequestError, EngineUnavailable):
            info = self.bridge.model_info = None
        emit(self.now_holding, info)
        if info is None:
            self.adapters.show()
