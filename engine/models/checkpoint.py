"""Putting a checkpoint's arrays into a family's module tree: quantize the tree exactly
as the checkpoint was, cast floats, and fill it with ``load_weights(strict=True)``, with
mlx's multi-line complaints turned into one readable line."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from engine.artifacts.config import QuantizationSpec
from engine.artifacts.mlx_quant import check_params, stored_params
from engine.errors import ModelLoadError

MX_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def quantize_like_checkpoint(
    model: Any, weights: Mapping[str, Any] | set[str], spec: QuantizationSpec | None, *, name: str = "the model"
) -> None:
    """Swap in quantized layers exactly where the checkpoint stores ``<module>.scales``.

    The file decides which modules are quantized, and how, as in mlx-lm: a module the
    config's block names gets that entry (mixed recipes, a router kept at 8 bits); any
    other gets the mode, bits and group size its stored arrays were packed with (the
    top-level default where only names are known). A mode or size MLX cannot run is
    refused in one line naming what it can.
    """
    import mlx.nn as nn

    quantized = {n[: -len(".scales")] for n in weights if n.endswith(".scales")}
    if not quantized:
        return
    if spec is None:
        raise ModelLoadError(
            f"{name} stores quantized weights but its config.json has no quantization block; re-download the model"
        )
    arrays = weights if isinstance(weights, Mapping) else {}
    default = {"bits": spec.bits, "group_size": spec.group_size, "mode": spec.mode}

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        if path not in quantized or not hasattr(module, "to_quantized"):
            return False
        if path not in spec.overrides and f"{path}.weight" in arrays:
            params = stored_params(module.weight.shape[-1], arrays[f"{path}.weight"], arrays[f"{path}.scales"])
            params["global_scale"] = f"{path}.global_scale" in arrays
        else:
            params = spec.params_for(path) or default
        check_params(params, where=f"{name} ({path})")
        # Only stacked experts hold nvfp4's per-expert scale; other layers do not take the flag.
        if params.pop("global_scale", False) and "global_scale" in inspect.signature(module.to_quantized).parameters:
            params["global_scale"] = True
        return params

    try:
        nn.quantize(model, class_predicate=predicate)
    except ValueError as e:
        raise ModelLoadError(f"{name}: cannot set up its quantization ({one_line(e)})") from None


def cast_floats(weights: dict[str, Any], dtype: str) -> dict[str, Any]:
    import mlx.core as mx

    target = getattr(mx, MX_DTYPE_NAMES.get(dtype, dtype))
    return {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != target else v
        for k, v in weights.items()
    }


def fill_weights(model: Any, weights: dict[str, Any], *, name: str = "the model") -> None:
    """``load_weights(strict=True)`` with mlx's multi-line complaints turned into one line."""
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        text = one_line(e)
        raise ModelLoadError(
            f"{name}: weights do not match its config.json ({text}); the files may be from another model or incomplete"
        ) from None


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
