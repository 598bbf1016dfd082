"""What every model load brings along: the memory budget chosen in Settings, and the adapter
folders that were mounted on that model before (re-mounted once it has loaded).

The main window calls ``budget_for_load`` before a load, hands ``remount`` to the bridge as
the load's preparation (so a message waiting for the model waits for its adapters too), and
``loaded`` / ``refusal`` after it. Everything that talks to the engine goes through the bridge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app import model_prefs
from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable
from app.memory_units import fmt_bytes
from app.qt import QObject, Signal, emit
from app.store import HistoryStore, StoreError
from app.ui.memory_gauge import MemoryGauge
from app.ui.settings_panel import SettingsPanel

KV_BITS_KEY = "kv_bits"
CONTEXT_CAP_KEY = "context_cap"  # tokens; absent: the model's context, as far as the budget holds
# Paged KV's block size: the engine's default (engine.models.paged_kv), chosen by measurement.
PAGED_BLOCK_SIZE = 64
# The Settings choices whose blocks are shared between chats and held quantized: their bits.
PAGED_QUANTIZED = {"paged-8": 8, "paged-4": 4}
UNSHARED = "unshared"  # the Settings choice: full precision, each chat's KV its own (unpaged)
# Before sharing was the default it was the choice "paged"; remembered so, it is the default now.
_SHARED = (None, "paged", *PAGED_QUANTIZED)


class LoadSetup(QObject):
    notice = Signal(str)  # a line for the status bar

    def __init__(
        self,
        store: HistoryStore,
        bridge: EngineBridge,
        settings: SettingsPanel,
        gauge: MemoryGauge,
        parent: QObject | None = None,
    ):
        super().__init__(parent)
        self.store, self.bridge, self.settings, self.gauge = store, bridge, settings, gauge
        self.skipped = ""  # the last remount's notice about adapters it had to forget
        settings.memory_budget_changed.connect(self.set_budget)
        settings.kv_bits_changed.connect(self.set_kv_bits)
        settings.context_cap_changed.connect(self.set_context_cap)
        settings.show_kv_bits(self.kv_choice())
        settings.show_context_cap(self.context_cap_for_load())
        self._show_budget()

    def _save(self, write: Any, *args: Any, **kwargs: Any) -> bool:
        """A preference write; one the history cannot take (full disk) is said, not raised:
        the load or the mount it belongs to has already happened."""
        try:
            write(*args, **kwargs)
        except StoreError as exc:
            emit(self.notice, f"{exc} This setting is not remembered.")
            return False
        return True

    # ---- the KV cache's precision -----------------------------------------------------------

    def kv_bits_for_load(self) -> int | None:
        """What LoadModel carries as kv_bits: 8 or 4 ("paged-8" and "paged-4" too, their blocks
        quantized), or None for the model's own setting."""
        bits = self.store.preference(KV_BITS_KEY)
        if bits in PAGED_QUANTIZED:
            return PAGED_QUANTIZED[bits]
        return bits if bits in (4, 8) else None

    def kv_choice(self) -> int | str | None:
        """The Settings choice as remembered: None (shared, the default), "unshared", 8, 4,
        "paged-8" or "paged-4"."""
        chosen = self.store.preference(KV_BITS_KEY)
        if chosen == UNSHARED or chosen in PAGED_QUANTIZED:
            return chosen
        return self.kv_bits_for_load()

    def paged_block_size_for_load(self) -> int | None:
        """What LoadModel carries as paged_kv_block_size: blocks shared between chats unless
        Settings asks for each chat's own cache (or a quantized one, unshared)."""
        return PAGED_BLOCK_SIZE if self.store.preference(KV_BITS_KEY) in _SHARED else None

    def set_kv_bits(self, bits: int | str | None) -> None:
        if not self._save(self.store.set_preference, KV_BITS_KEY, bits):
            self.settings.show_kv_bits(self.kv_choice())
            return
        if self.bridge.model_info is not None:
            emit(self.notice, "The new context memory setting applies from the next model load.")

    def context_cap_for_load(self) -> int | None:
        """What LoadModel carries as context_cap: the user's cap in tokens, or None."""
        cap = self.store.preference(CONTEXT_CAP_KEY)
        return int(cap) if isinstance(cap, int) and cap > 0 else None

    def set_context_cap(self, cap: int | None) -> None:
        if not self._save(self.store.set_preference, CONTEXT_CAP_KEY, cap):
            self.settings.show_context_cap(self.context_cap_for_load())
            return
        if self.bridge.model_info is not None:
            emit(self.notice, "The new context length applies from the next model load.")

    # ---- the memory budget ----------------------------------------------------------------

    def setting(self) -> model_prefs.BudgetSetting:
        return model_prefs.budget_setting(self.store, self.gauge.figures.get("total_bytes", 0))

    def budget_for_load(self) -> int | None:
        """What LoadModel carries: the custom budget, or None for the engine's automatic one."""
        return self.setting().custom

    def set_budget(self, custom: int | None) -> None:
        """The Settings control changed: remember it. A loaded model keeps the budget it was
        loaded under; the new one applies from the next load, and the status bar says so
        (and whether the loaded model would still fit it)."""
        if not self._save(model_prefs.set_budget, self.store, custom):
            self._show_budget()  # the control goes back to what is remembered
            return
        self._show_budget()
        setting = self.setting()
        line = f"Memory budget: {fmt_bytes(setting.effective)}"
        line += "." if custom is not None else " (automatic)."
        info = self.bridge.model_info
        plan = info.plan if info is not None else None
        if plan is not None and plan.budget_bytes != setting.effective:
            line += (
                f" {info.name} keeps its {fmt_bytes(plan.budget_bytes)} until it is loaded "
                "again; the new budget applies from the next load."
            )
            if plan.weights_bytes >= setting.effective:
                line += (
                    f" {info.name} needs {fmt_bytes(plan.weights_bytes)} for its weights, "
                    "so it would not load under the new budget."
                )
        emit(self.notice, line)

    def loaded(self, info: Any, budget: int | None) -> None:
        """A load succeeded under ``budget`` (None: automatic): learn the machine's figures."""
        self._save(model_prefs.note_loaded_plan, self.store, info.plan, automatic=budget is None)
        self._show_budget()
        self.settings.show_context_advice(info.context_advice, info.name)

    def _show_budget(self) -> None:
        setting = self.setting()
        plan = getattr(self.bridge.model_info, "plan", None)
        note = f"This machine has {fmt_bytes(setting.total)}." if setting.total else ""
        if plan is not None and plan.budget_bytes != setting.effective:
            note += (
                f" The loaded model runs under {fmt_bytes(plan.budget_bytes)}; "
                f"{fmt_bytes(setting.effective)} applies from the next load."
            )
        self.settings.show_memory_budget(setting, note.strip())
        self.gauge.set_next_budget(setting.effective)

    async def refusal(self, path: str, budget: int | None, engine_reason: str) -> str:
        """The line shown when a load is refused for memory: what the model needs against the
        budget, and whether raising the budget in Settings would let it load."""
        try:
            info = await self.bridge.inspect(path)  # headers only: quick, loads nothing
        except (EngineRequestError, EngineUnavailable):
            return engine_reason
        plan = info.plan
        if plan is None:
            return engine_reason
        setting = self.setting()
        setting.custom = budget
        setting.total = plan.total_bytes or setting.total
        if budget is None:
            setting.automatic = plan.budget_bytes  # inspect plans under the automatic budget
        if plan.weights_bytes < setting.effective:
            return engine_reason  # the weights fit: the context length asked for does not
        return model_prefs.refusal_message(info.name, plan.weights_bytes, setting)

    async def draft_refusal(self, path: str, engine_reason: str) -> str:
        """The line shown when a draft model does not fit beside the loaded one."""
        loaded = self.bridge.model_info
        try:
            info = await self.bridge.inspect(path)
        except (EngineRequestError, EngineUnavailable):
            return engine_reason
        if info.plan is None or loaded is None or loaded.plan is None:
            return engine_reason
        return model_prefs.draft_refusal_message(
            info.name, info.plan.weights_bytes, loaded.name, loaded.plan.weights_bytes, loaded.plan.budget_bytes
        )

    # ---- adapters remembered per model --------------------------------------------------------

    def remember(self, adapter: Any) -> None:
        info = self.bridge.model_info
        if info is not None:
            self._save(model_prefs.remember_adapter, self.store, info.path, adapter.path, adapter.name)

    def forget(self, name: str) -> None:
        info = self.bridge.model_info
        if info is not None:
            self._save(model_prefs.forget_adapters, self.store, info.path, {name})

    async def remount(self, info: Any) -> None:
        """Mount again the adapter folders remembered for this model, in their old order. A
        folder that is gone or no longer fits is skipped and forgotten; ``skipped`` holds one
        line naming them all (empty when none)."""
        self.skipped = ""
        skipped: list[str] = []
        gone: set[str] = set()
        for entry in model_prefs.remembered_adapters(self.store, info.path):
            if self.bridge.active_load is not None:
                return  # another load is queued: these adapters belong to the model it replaces
            name, folder = entry["name"], entry["path"]
            if not Path(folder).is_dir():
                skipped.append(f"{name} (its folder {folder} is gone)")
                gone.add(name)
                continue
            try:
                await self.bridge.mount_adapter(folder, name)
            except EngineRequestError as exc:
                skipped.append(f"{name} ({exc})")
                gone.add(name)
            except EngineUnavailable:
                return  # the engine is gone: nothing more can be mounted, nothing to forget
        if skipped:
            self._save(model_prefs.forget_adapters, self.store, info.path, gone)
            self.skipped = (
                f"Skipped {len(skipped)} adapter{'s' if len(skipped) > 1 else ''} "
                f"mounted on {info.name} before, and forgot "
                f"{'them' if len(skipped) > 1 else 'it'}: " + "; ".join(skipped)
            )
