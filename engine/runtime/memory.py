"""Memory plans from file headers, budget checks, and live memory figures.

A plan is made before any weight is loaded: weights from the safetensors/GGUF headers
(quantized tensors are counted at their packed size), KV cache from the model family's
shape: per token for full-attention layers, up to a fixed maximum for sliding-window
layers (their rotating caches hold at most the window). Loading refuses up front when
the weights do not fit the budget, so a too-large model never half-allocates and takes
the machine into swap.
"""

from __future__ import annotations

import os
from typing import Any

from engine.api import KVWindow, MemoryPlan
from engine.errors import OutOfMemoryBudget
from engine.models import cache_sizes

GB = 1e9


def total_memory() -> int:
    """The machine's memory in bytes (the device's, on Apple silicon)."""
    info = _device_info()
    size = info.get("memory_size")
    if isinstance(size, int) and size > 0:
        return size
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_budget() -> tuple[int, str]:
    """The budget a load gets unless told otherwise, with a phrase saying where it comes from."""
    info = _device_info()
    recommended = info.get("max_recommended_working_set_size")
    if isinstance(recommended, int) and recommended > 0:
        return recommended, f"the device's recommended working set of {format_bytes(recommended)}"
    total = total_memory()
    return int(total * 0.75), f"75% of {format_bytes(total, digits=0)} RAM"


def _device_info() -> dict[str, Any]:
    try:
        import mlx.core as mx
    except ImportError:
        return {}
    for getter in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if getter is None:
            continue
        try:
            info = getter()
        except Exception:  # a backend without the query raises; the next source answers
            continue
        if isinstance(info, dict):
            return info
    return {}


def format_bytes(n: float, digits: int = 1) -> str:
    if n >= GB:
        return f"{n / GB:.{digits}f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.{digits}f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.{digits}f} KB"
    return f"{int(n)} B"


def _family_args(config: Any) -> Any:
    from engine import models

    return models.get_family(config.model_type).ModelArgs.from_dict(config.raw)


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """KV cache bytes per token of a config's full-attention layers, by its family's formula."""
    return int(cache_sizes.kv_bytes_per_token(_family_args(config), dtype_bytes))


def kv_windows(config: Any, dtype_bytes: int) -> list[KVWindow]:
    """A config's sliding-window layers, grouped by window, with their KV bytes."""
    return [
        KVWindow(tokens=w, layers=n, bytes_per_token=b)
        for w, n, b in cache_sizes.kv_window_groups(_family_args(config), dtype_bytes)
    ]


def state_bytes(config: Any, dtype_bytes: int) -> int:
    """A config's recurrent-layer state as fixed bytes: the live state plus the snapshots a
    chat session keeps for prefix reuse (engine/models/recurrent_cache.py bounds them)."""
    from engine.models.recurrent_cache import COPIES_KEPT

    return int(cache_sizes.recurrent_state_bytes(_family_args(config), dtype_bytes)) * COPIES_KEPT


def plan_memory(
    config: Any,
    headers: dict[str, Any] | None = None,
    budget: int | None = None,
    *,
    weights_bytes: int | None = None,
    dtype_bytes: int = 2,
    mtp_bytes: int = 0,
    mtp_loaded: bool = False,
    left_out_bytes: int = 0,
) -> MemoryPlan:
    """What a model needs: ``headers`` (name -> TensorInfo) or ``weights_bytes`` for the weights.

    ``dtype_bytes`` is the width of the activations and KV cache (2 for bf16/fp16 models,
    4 for fp32 ones).
    """
    if weights_bytes is None:
        weights_bytes = sum(info.nbytes for info in (headers or {}).values())
    if budget is None:
        budget, _ = default_budget()
    return MemoryPlan(
        weights_bytes=int(weights_bytes),
        kv_bytes_per_token=kv_bytes_per_token(config, dtype_bytes),
        budget_bytes=int(budget),
        total_bytes=total_memory(),
        kv_windows=kv_windows(config, dtype_bytes),
        state_bytes=state_bytes(config, dtype_bytes),
        mtp_bytes=int(mtp_bytes),
        mtp_loaded=bool(mtp_loaded and mtp_bytes),
        left_out_bytes=int(left_out_bytes),
    )


def check_fits(
    plan: MemoryPlan,
    *,
    context_tokens: int = 0,
    name: str = "This model",
    budget_reason: str | None = None,
) -> None:
    """Raise OutOfMemoryBudget, with the numbers, when weights (+ a context) exceed the budget."""
    kv = plan.kv_bytes(context_tokens)
    need = plan.weights_bytes + kv
    if need < plan.budget_bytes:
        return
    what = f"{format_bytes(plan.weights_bytes)} for its weights"
    if kv:
        what += f" and {format_bytes(kv)} for a {context_tokens:,}-token context"
    budget = format_bytes(plan.budget_bytes)
    if budget_reason:
        budget += f" ({budget_reason})"
    if kv and plan.weights_bytes < plan.budget_bytes and plan.kv_limits_context:
        advice = f"Use a context of at most {plan.max_context:,} tokens, or raise --memory-budget."
    else:
        advice = "Pick a smaller or more quantized model, or raise --memory-budget."
    raise OutOfMemoryBudget(f"{name} needs {what}; the memory budget is {budget}. {advice}")


def parse_budget(text: str) -> int:
    """``--memory-budget`` values: bytes, or with a unit (``12GB``, ``800MB``, ``12g``)."""
    s = text.strip().lower().replace(" ", "").removesuffix("b").removesuffix("i")
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    scale = 1.0
    if s and s[-1] in units:
        scale = units[s[-1]]
        s = s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise OutOfMemoryBudget(f"cannot read memory budget {text!r}; write it like 12GB or 800MB") from None
    if value <= 0:
        raise OutOfMemoryBudget(f"memory budget {text!r} must be positive")
    return int(value)


def live_memory() -> dict[str, int]:
    """MLX's own figures: bytes in live arrays, in its buffer cache, and the peak so far."""
    import mlx.core as mx

    return {
        "active": int(mx.get_active_memory()),
        "cache": int(mx.get_cache_memory()),
        "peak": int(mx.get_peak_memory()),
    }


# ---- quantized KV cache ------------------------------------------------------------------


def kv_settings_for(model: Any, path: str, bits: int | None, group_size: int = 64) -> list | None:
    """Each layer's KV setting ((bits, group size) or None) for a loaded model: ``bits`` for
    every layer when given, else the folder's kv_config.json, else None (full precision).
    Only plain full-attention caches are quantized; other layers' settings are dropped."""
    from engine.models.kv_cache import KVCache, make_prompt_cache
    from engine.models.quantized_kv_cache import kv_layer_settings, uniform

    if not hasattr(model, "make_cache") and not hasattr(model, "layers"):
        return None  # a model that keeps no KV cache (a sentence embedder)
    plain = [type(c) is KVCache for c in make_prompt_cache(model)]
    if bits is not None:
        settings = uniform(bits, group_size, len(plain))
    else:
        settings = kv_layer_settings(path, len(plain))
    if settings is None:
        return None
    settings = [s if ok else None for s, ok in zip(settings, plain)]
    return settings if any(s is not None for s in settings) else None


def with_kv_settings(info: Any, config: Any, settings: list | None) -> Any:
    """``info`` with its memory plan counting a quantized KV cache, and ``kv_cache`` naming it."""
    from dataclasses import replace

    from engine.models.quantized_kv_cache import describe, kv_bytes_per_token_factor

    if not settings:
        return info
    plan = info.plan
    if plan is not None and plan.kv_bytes_per_token:
        one = kv_bytes_per_token(config, 1) or 1
        dtype_bytes = max(1, round(plan.kv_bytes_per_token / one))
        quantized = [s for s in settings if s is not None]
        # The plan's per-token figure is the full-attention layers', which are the ones quantized.
        full = max(len(quantized), sum(1 for w in _windows(config) if w is None)) or 1
        factor = (
            sum(kv_bytes_per_token_factor(b, g, dtype_bytes) for b, g in quantized) + (full - len(quantized))
        ) / full
        plan = replace(plan, kv_bytes_per_token=int(round(plan.kv_bytes_per_token * factor)))
    return replace(info, plan=plan, kv_cache=describe(settings))


def _windows(config: Any) -> list:

    try:
        return list(cache_sizes.layer_windows(_family_args(config)))
    except Exception:  # noqa: BLE001 - a family without the helper: count nothing extra
        return []


def kv_settings_from_config(config: Any, path: Any, bits: int | None, group_size: int = 64) -> list | None:
    """``kv_settings_for`` from the files alone (``inspect``): the full-attention layers of a
    family whose cache is keys and values per head."""
    from engine.models.quantized_kv_cache import kv_layer_settings, uniform

    if callable(getattr(_family_args(config), "kv_bytes_per_token", None)):
        return None  # a latent (MLA) cache: not quantized
    windows = _windows(config)
    if not windows:
        return None
    settings = uniform(bits, group_size, len(windows)) if bits is not None else kv_layer_settings(path, len(windows))
    if settings is None:
        return None
    settings = [s if w is None else None for s, w in zip(settings, windows)]
    return settings if any(s is not None for s in settings) else None
