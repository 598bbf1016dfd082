"""Loading a DFlash block drafter as the draft model (``Host.load_draft``).

A folder whose config.json describes a DFlash drafter (``engine.models.dflash``) is read for
the loaded model and checked against it (target layers, hidden size, vocabulary, mask token);
it has no tokenizer of its own (it drafts in the target's), so the vocabulary check is the
model's. Its weights must fit in what the memory budget leaves beside the target.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from engine.api import ModelInfo
from engine.errors import OutOfMemoryBudget


def is_dflash_drafter(path: str) -> bool:
    """Is ``path`` (a folder, or a Hub name already downloaded) a DFlash drafter?"""
    from engine.artifacts.hub import resolve_model_path
    from engine.errors import EngineError
    from engine.models.dflash import is_dflash_dir

    try:
        return is_dflash_dir(resolve_model_path(path))
    except (EngineError, OSError, ValueError):  # not resolvable here: the ordinary draft loader says why
        return False


def load_dflash_drafter(
    path: str,
    target: Any,
    budget: int | None,
    progress: Any = None,
    cancel: threading.Event | None = None,
) -> tuple[Any, ModelInfo]:
    """(drafter, its description) for ``target``; refuses a mismatch or a damaged file in one line."""
    from mlx.utils import tree_flatten

    from engine.artifacts.hub import resolve_model_path
    from engine.decode.dflash_drafter import check_target
    from engine.models.dflash import load_dflash

    check_target(target)  # before reading anything: a family whose layers cannot be read
    folder = Path(resolve_model_path(path))
    if progress is not None:
        progress(0, 1, "loading the DFlash drafter")
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if budget is not None and on_disk > budget:
        raise OutOfMemoryBudget(
            f"The DFlash drafter ({on_disk / 2**20:.0f} MiB) does not fit beside the loaded model "
            f"({budget / 2**20:.0f} MiB left): raise the memory budget"
        )
    model = load_dflash(folder, target)
    if progress is not None:
        progress(1, 1, "loading the DFlash drafter")
    params = tree_flatten(model.parameters())
    spec = model.args.quantization
    quant = f"{spec['bits']}-bit g{spec['group_size']}" if spec else str(params[0][1].dtype).split(".")[-1]
    info = ModelInfo(
        path=str(folder),
        name=folder.name,
        family="dflash",
        parameters=sum(v.size for _, v in params),
        quantization=quant,
        size_on_disk=on_disk,
        context_length=0,
    )
    return model, info
