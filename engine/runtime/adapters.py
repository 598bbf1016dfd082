"""The LoRA adapters on the loaded model, as the host serves them (engine.models.lora
mounts and activates them). Adapters stay mounted across generations and go with the
model when it is unloaded. An adapter may name modules of a built-in MTP layer that was
set apart at load and not read yet: it takes them when the layer is read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.api import AdapterInfo
from engine.models import lora


def mount(model: Any, mtp_apart: Any, path: str, name: str | None = None) -> AdapterInfo:
    """Mount an mlx-lm or PEFT adapter folder on ``model`` (inactive until ``activate``);
    refused with what does not match."""
    unread = {"mtp": mtp_apart.head} if mtp_apart is not None else None
    return adapter_info(lora.mount(model, path, name, unread=unread))


def activate(model: Any, scales: Mapping[str, float]) -> None:
    """Make exactly these mounted adapters active, each with its scale (1.0 = as trained)."""
    lora.activate(model, dict(scales))


def unmount(model: Any, name: str) -> None:
    lora.unmount(model, name)


def mounted(model: Any) -> list[AdapterInfo]:
    return [adapter_info(a) for a in lora.mounted(model)]


def active(model: Any) -> dict[str, float]:
    return lora.active_adapters(model)


def adapter_info(a: Any) -> AdapterInfo:
    return AdapterInfo(
        name=a.name,
        path=a.path,
        format=a.format,
        kind=a.kind,
        rank=a.rank,
        targets=len(a.targets),
        base_model=a.base_model,
    )
