"""``inspect``: what a model is and what it needs, from its files' headers alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.api import MemoryPlan, ModelInfo
from engine.artifacts.hub import describe_read, resolve_model_path
from engine.runtime.context_planner import advise_context, check_cap, precision_options
from engine.runtime.expert_plan import describe_residency, residency_for_inspect
from engine.runtime.loading import DTYPE_BYTES, inspect_source
from engine.runtime.memory import (
    default_budget,
    format_bytes,
    kv_settings_from_config,
    plan_memory,
    with_kv_settings,
)


def inspect_model(
    path: str | Path,
    *,
    memory_budget: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    kv_config: bool = True,
    context_cap: int | None = None,
    refuse_cap: bool = False,
    resident_experts: float | None = None,
    plan: MemoryPlan | None = None,
    source: Any = None,
) -> ModelInfo:
    """Describe a model folder, cached repo id or .gguf file without loading weights; the
    memory plan counts a quantized KV cache (``kv_bits``, else with ``kv_config`` the
    folder's kv_config.json; the host applies its own when it loads) and advises on the
    context (engine.runtime.context_planner); with ``refuse_cap``, a ``context_cap`` the
    budget cannot hold raises OutOfMemoryBudget. ``plan``: the plan a load already made from
    the same files, which stands (the files are not planned twice in one load); ``source``:
    what that load read of them (``LoadedModel.source``), described without a second read.
    Either way the config and headers are read once."""
    if source is None:
        source = inspect_source(resolve_model_path(path))
    resolved = source.path
    read = source.gguf_header if source.gguf else source.headers
    entry = describe_read(resolved, source.config, read, source="gguf" if resolved.is_file() else "folder")
    if entry.error:
        from engine.errors import ModelLoadError

        raise ModelLoadError(entry.error)
    if plan is None:
        budget = memory_budget if memory_budget is not None else default_budget()[0]
        plan = plan_memory(
            source.config,
            budget=budget,
            weights_bytes=source.weights_bytes - source.mtp_bytes,  # the MTP layer loads only with --mtp
            dtype_bytes=DTYPE_BYTES[source.dtype],
            mtp_bytes=source.mtp_bytes,
            left_out_bytes=source.left_out_bytes,
        )
        plan = residency_for_inspect(plan, source, resident_experts, context_cap or 0)
    config = source.config
    info = ModelInfo(
        path=str(resolved),
        name=source.name,
        family=config.model_type,
        parameters=entry.parameters,
        quantization=entry.quantization,
        size_on_disk=entry.size_on_disk,
        context_length=config.context_length,
        plan=plan,
        vision=config.vision,
        audio=config.audio,
        generation_defaults=dict(config.generation_defaults),
    )
    if kv_bits is None and not kv_config:
        return info
    folder = resolved if resolved.is_dir() else resolved.parent
    loaded = with_kv_settings(info, config, kv_settings_from_config(config, folder, kv_bits, kv_group_size))
    options = precision_options(info, config, lambda bits: kv_settings_from_config(config, folder, bits, kv_group_size))
    if loaded.plan is None or not options:
        return loaded
    if refuse_cap:
        check_cap(context_cap, loaded.plan, options, info.name)
    return replace(loaded, context_advice=advise_context(loaded.plan, options, info.context_length, context_cap))


def format_inspect(info: ModelInfo) -> str:
    """A human-readable report of ``inspect_model``'s answer."""
    lines = [
        f"model         {info.name}",
        f"path          {info.path}",
        f"family        {info.family}",
        f"parameters    {_count(info.parameters)}",
        f"quantization  {info.quantization}{_bits_per_weight(info)}",
        f"size on disk  {format_bytes(info.size_on_disk)}",
        f"context       {info.context_length:,} tokens",
    ]
    extras = [name for name, on in (("vision", info.vision), ("audio", info.audio)) if on]
    if extras:
        lines.append(f"inputs        text, {', '.join(extras)}")
    if info.generation_defaults:
        defaults = ", ".join(f"{k}={v}" for k, v in sorted(info.generation_defaults.items()))
        lines.append(f"defaults      {defaults}")
    plan = info.plan
    if plan is not None:
        lines += [
            "memory plan",
            f"  weights       {format_bytes(plan.weights_bytes)}",
        ]
        if plan.mtp_bytes and plan.mtp_loaded:
            lines.append(f"  MTP layer     {format_bytes(plan.mtp_bytes)} of the weights (built-in drafting, --mtp)")
        elif plan.mtp_bytes:  # read only when MTP drafting asks for it
            lines.append(
                f"  MTP layer     {format_bytes(plan.mtp_bytes)} more, loaded only for built-in drafting (--mtp): "
                f"{format_bytes(plan.weights_bytes + plan.mtp_bytes)} of weights then"
            )
        lines += describe_residency(plan, info.path)
        if plan.left_out_bytes:
            lines.append(
                f"  not loaded    {format_bytes(plan.left_out_bytes)} stored but never loaded "
                "(MTP layers decoding does not run, the MTP layer's copies of the embedding and head)"
            )
        lines += [
            f"  KV per token  {format_bytes(plan.kv_bytes_per_token)}"
            + (f" (cache held at {info.kv_cache})" if info.kv_cache else ""),
        ]
        # Sliding-window layers: their share of the cache stops growing at the window.
        lines += [
            f"  KV window     {w.layers} {'layer keeps' if w.layers == 1 else 'layers keep'} at most "
            f"{w.tokens:,} tokens: {format_bytes(w.max_bytes)} at most"
            for w in plan.kv_windows
        ]
        if plan.state_bytes:  # recurrent layers: the same at any context length
            lines.append(f"  recurrent state {format_bytes(plan.state_bytes)} fixed (with prefix-reuse snapshots)")
        lines.append(f"  budget        {format_bytes(plan.budget_bytes)} of {format_bytes(plan.total_bytes)}")
        if not plan.fits:
            lines.append("  fits          no: the weights alone exceed the budget")
        elif not plan.kv_limits_context and not info.context_length:
            lines.append("  max context   any length (every layer keeps a fixed window)")
        else:
            usable = min(plan.max_context, info.context_length) if info.context_length else plan.max_context
            if info.context_advice is not None and info.context_advice.limit:
                usable = info.context_advice.limit  # with the user's cap, as sessions enforce it
            full = info.context_length and plan.max_context >= info.context_length
            note = " (the model's full context)" if full else ""
            lines.append(f"  max context   {usable:,} tokens{note}")
    advice = info.context_advice
    if advice is not None and advice.note:
        lines.append(f"  recommended   {advice.note}")
    return "\n".join(lines)


def _bits_per_weight(info: ModelInfo) -> str:
    """Stored bits per parameter, scales and biases included (mlx-lm's figure: affine 4-bit
    g64 is 4.5, mxfp4 4.25, nvfp4 4.5, plus whatever layers stay in bf16)."""
    plan = info.plan
    if plan is None or not info.parameters:
        return ""
    # The parameters count every stored tensor: so do the bytes, loaded or not.
    stored = plan.weights_bytes + (0 if plan.mtp_loaded else plan.mtp_bytes) + plan.left_out_bytes
    stored += plan.experts.streamed_bytes if plan.experts is not None else 0
    return f" ({8 * stored / info.parameters:.2f} bits per weight)"


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return f"{n:,}"
