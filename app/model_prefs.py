"""What the app remembers about loading models, kept in the history's preferences so a
data folder carries it: the memory budget and, per model, the adapter folders mounted on it.

No widgets here: the main window reads and writes these, the settings panel only shows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.memory_units import fmt_bytes, machine_memory
from app.store import HistoryStore

BUDGET_KEY = "memory_budget"  # bytes; absent: automatic (the engine's default)
AUTO_BUDGET_KEY = "memory_budget_auto"  # the engine's default, as the last automatic load reported
MACHINE_KEY = "machine_memory"  # bytes, as the engine last reported them
ADAPTERS_KEY = "mounted_adapters"  # model path -> [{"path": folder, "name": name}, ...]
AUTO_SHARE = 0.75  # the engine's default where the device recommends nothing


# ---- the memory budget ----------------------------------------------------------------


@dataclass
class BudgetSetting:
    """The user's choice (None: automatic) and the figures the control is drawn against."""

    custom: int | None
    automatic: int  # what automatic means on this machine (bytes)
    total: int  # the machine's memory (bytes); the highest custom value allowed

    @property
    def effective(self) -> int:
        return self.custom if self.custom is not None else self.automatic

    def describe(self) -> str:
        return (
            f"{fmt_bytes(self.custom)} (set in Settings)"
            if self.custom is not None
            else f"{fmt_bytes(self.automatic)} (automatic)"
        )


def budget_setting(store: HistoryStore, total: int = 0) -> BudgetSetting:
    """The remembered budget. ``total`` is the machine's memory as the engine reported it;
    without it the operating system's figure is used."""
    total = total or int(store.preference(MACHINE_KEY, 0) or 0) or machine_memory()
    automatic = int(store.preference(AUTO_BUDGET_KEY, 0) or 0) or int(total * AUTO_SHARE)
    custom = store.preference(BUDGET_KEY)
    custom = min(int(custom), total) if isinstance(custom, (int, float)) and custom > 0 else None
    return BudgetSetting(custom=custom, automatic=automatic, total=total)


def set_budget(store: HistoryStore, custom: int | None) -> None:
    store.set_preference(BUDGET_KEY, int(custom) if custom else None)


def note_loaded_plan(store: HistoryStore, plan: Any, automatic: bool) -> None:
    """Learn the machine's memory, and the engine's automatic budget from a load that used it
    (on Apple silicon it is the device's recommended working set, not a fixed share)."""
    if plan is None:
        return
    if plan.total_bytes and plan.total_bytes != store.preference(MACHINE_KEY):
        store.set_preference(MACHINE_KEY, int(plan.total_bytes))
    if automatic and plan.budget_bytes != store.preference(AUTO_BUDGET_KEY):
        store.set_preference(AUTO_BUDGET_KEY, int(plan.budget_bytes))


def refusal_message(name: str, need: int, budget: BudgetSetting) -> str:
    """Why a model was refused for memory, and the way out: a higher budget in Settings when
    one within the machine's memory would take it, else a smaller model."""
    head = f"{name} needs {fmt_bytes(need)} for its weights; the memory budget is {budget.describe()}."
    if budget.total and need >= budget.total:
        return (
            f"{name} needs {fmt_bytes(need)} for its weights, more than this machine's "
            f"{fmt_bytes(budget.total)} of memory: pick a smaller or more quantized model."
        )
    if budget.total:
        return (
            f"{head} Raise the memory budget in Settings (up to {fmt_bytes(budget.total)} "
            "on this machine) to load it, or pick a smaller or more quantized model."
        )
    return f"{head} Raise the memory budget in Settings, or pick a smaller or more quantized model."


def draft_refusal_message(name: str, need: int, loaded: str, loaded_need: int, budget: int) -> str:
    """Why a draft model was refused: it must fit in the budget beside the loaded model."""
    return (
        f"{name} needs {fmt_bytes(need)} beside the {fmt_bytes(loaded_need)} {loaded} takes, "
        f"over the {fmt_bytes(budget)} memory budget {loaded} loaded under. Pick a smaller "
        f"draft model, or raise the memory budget in Settings and load {loaded} again."
    )


# ---- adapters remembered per model -----------------------------------------------------------


def remembered_adapters(store: HistoryStore, model_path: str) -> list[dict[str, str]]:
    """The adapter folders mounted on this model, in mount order: [{"path", "name"}]."""
    table = store.preference(ADAPTERS_KEY, {}) or {}
    entries = table.get(model_path, []) if isinstance(table, dict) else []
    return [
        {"path": str(e["path"]), "name": str(e["name"])}
        for e in entries
        if isinstance(e, dict) and e.get("path") and e.get("name")
    ]


def remember_adapter(store: HistoryStore, model_path: str, adapter_path: str, name: str) -> None:
    entries = [e for e in remembered_adapters(store, model_path) if e["name"] != name]
    _write(store, model_path, entries + [{"path": adapter_path, "name": name}])


def forget_adapters(store: HistoryStore, model_path: str, names: set[str]) -> None:
    entries = remembered_adapters(store, model_path)
    kept = [e for e in entries if e["name"] not in names]
    if kept != entries:
        _write(store, model_path, kept)


def _write(store: HistoryStore, model_path: str, entries: list[dict[str, str]]) -> None:
    table = store.preference(ADAPTERS_KEY, {}) or {}
    if not isinstance(table, dict):
        table = {}
    if entries:
        table[model_path] = entries
    else:
        table.pop(model_path, None)
    store.set_preference(ADAPTERS_KEY, table or None)


# ---- the models this app has met ------------------------------------------------------------

FOLDERS_KEY = "model_folders"  # folders added in the model browser ("Add folder…"), in order
RECENT_KEY = "recent_models"  # paths of the models loaded lately, most recent first
RECENT_KEPT = 12  # the browser lists these beside the cache; more would crowd it with old trials


def _paths(store: HistoryStore, key: str) -> list[str]:
    value = store.preference(key, []) or []
    return [str(p) for p in value if isinstance(p, str) and p] if isinstance(value, list) else []


def added_folders(store: HistoryStore) -> list[str]:
    return _paths(store, FOLDERS_KEY)


def add_folder(store: HistoryStore, folder: str) -> None:
    folders = added_folders(store)
    if folder not in folders:
        store.set_preference(FOLDERS_KEY, folders + [folder])


def recent_models(store: HistoryStore) -> list[str]:
    """Models loaded lately, most recent first (some may have been moved or deleted since)."""
    return _paths(store, RECENT_KEY)


def note_loaded_model(store: HistoryStore, path: str) -> None:
    """A model loaded: it heads the recent list, and is the one loaded at the next start."""
    recent = [path] + [p for p in recent_models(store) if p != path]
    if recent != recent_models(store):
        store.set_preference(RECENT_KEY, recent[:RECENT_KEPT])


def last_model(store: HistoryStore) -> str | None:
    recent = recent_models(store)
    return recent[0] if recent else None


def forget_model(store: HistoryStore, path: str) -> None:
    """A remembered model that is gone (moved, deleted): no longer offered or reloaded."""
    recent = recent_models(store)
    if path in recent:
        store.set_preference(RECENT_KEY, [p for p in recent if p != path] or None)
