"""The expert residency plan: which part of an MoE model's routed experts stays in memory.

Made from the file headers before any weight is read. When the whole checkpoint does not
fit the budget (or ``--resident-experts F`` asks for a share), every non-expert weight
stays resident and each MoE layer gets a slab of expert slots, sized from what the budget
leaves after those weights and the KV cache of the context (``DEFAULT_CONTEXT`` tokens when
the caller names none). A model whose non-expert part plus a minimal slab (one token's
experts per layer) does not fit is refused in one line with the numbers.

At load (``stream_experts``), the slab arrays replace the stacked expert arrays before the
module tree is filled, so the stored experts are never read whole: the lazy arrays over
the files are dropped unevaluated, and each slab is then filled from byte ranges.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import replace
from typing import Any

from engine.api import ExpertResidency, MemoryPlan
from engine.errors import ModelLoadError, OutOfMemoryBudget

DEFAULT_CONTEXT = 4096
_EXPERT = re.compile(r"(^|\.)(experts|switch_mlp|switch_glu)\.")
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT_COUNT = ("num_experts", "n_routed_experts", "num_local_experts")
# What decode speed an expert read costs is estimated with these when nothing is measured.
ASSUMED_MEMORY_RATE = 100e9  # bytes/s the device reads resident weights at
ASSUMED_DISK_RATE = 2e9  # bytes/s of a laptop SSD's random 1 MB reads


def is_routed_expert(name: str) -> bool:
    """Whether a stored tensor is part of a layer's routed experts (not a shared expert,
    not the router)."""
    return bool(_EXPERT.search(name))


def family_streams_experts(model_type: str) -> bool:
    """Whether the family manifest says this model type's experts may be read from disk."""
    from engine.models.families import FAMILIES

    family = FAMILIES.get(model_type)
    return family is not None and family.streams_experts


def expert_count(args: Any) -> int:
    for attr in _EXPERT_COUNT:
        value = getattr(args, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    text = getattr(args, "text_config", None)
    return expert_count(text) if text is not None and text is not args else 0


def plan_residency(
    plan: MemoryPlan,
    expert_bytes: int,
    layers: int,
    args: Any,
    *,
    forced: float | None,
    context_tokens: int = 0,
    model_context: int = 0,
    name: str = "This model",
    streams: bool = True,
) -> MemoryPlan:
    """``plan`` with its experts' residency decided (unchanged for a dense model; every
    expert resident for one that fits and is not forced). ``expert_bytes``: every routed expert of the loaded
    layers as held in memory; ``layers``: the MoE layers holding them. The KV cache kept
    room for is that of ``context_tokens`` (the context chats may reach), else of the
    model's context up to ``DEFAULT_CONTEXT``. ``streams``: the family streams its experts
    (``Family.streams_experts`` of the manifest); when not, every expert stays resident."""
    experts = expert_count(args)
    if not expert_bytes or not experts or not layers:
        if forced is not None and forced < 1:
            raise ModelLoadError(f"{name} is not a mixture-of-experts model: --resident-experts does not apply to it")
        return plan
    if not streams:
        if forced is not None and forced < 1:
            raise ModelLoadError(
                f"{name}'s family does not read its experts from disk: it holds them all "
                "(leave --resident-experts out, or set it to 1)"
            )
        return plan
    top_k = max(
        1,
        int(
            getattr(args, "num_experts_per_tok", 0)
            or getattr(getattr(args, "text_config", None), "num_experts_per_tok", 1)
            or 1
        ),
    )
    per_slot = expert_bytes / experts  # one slot in every layer
    rest = plan.weights_bytes - expert_bytes
    if forced is not None:
        if not 0 < forced:
            raise ModelLoadError(f"--resident-experts must be above 0 (got {forced})")
        slots = experts if forced >= 1 else max(1, min(experts, round(forced * experts)))
    else:
        kv = plan.kv_bytes(context_tokens or min(DEFAULT_CONTEXT, model_context or DEFAULT_CONTEXT))
        fits = plan.weights_bytes + kv < plan.budget_bytes
        slots = experts if fits else min(experts, int((plan.budget_bytes - rest - kv) // per_slot))
        if slots < top_k:
            from engine.runtime.memory import format_bytes

            raise OutOfMemoryBudget(
                f"{name} needs {format_bytes(rest)} for its non-expert weights, "
                f"{format_bytes(top_k * per_slot)} for a minimal slab of {top_k} experts per layer and "
                f"{format_bytes(kv)} for the KV cache; the memory budget is {format_bytes(plan.budget_bytes)}. "
                "Pick a smaller or more quantized model, or raise --memory-budget."
            )
    slab = expert_bytes if slots == experts else int(round(slots * per_slot))
    residency = ExpertResidency(expert_bytes, slab, layers, experts, slots, top_k)
    residency.speed_share = speed_share(residency, rest + slab)
    return replace(plan, weights_bytes=rest + slab, experts=residency)


def residency_for_inspect(plan: MemoryPlan, source: Any, forced: float | None, context_tokens: int) -> MemoryPlan:
    """``inspect``'s plan: as a load would make it; one a load would refuse stays as it was
    (the report then says the weights do not fit)."""
    if getattr(source, "gguf", True) or not source.expert_bytes:
        return plan
    from engine import models

    try:
        args = models.get_family(source.config.model_type).ModelArgs.from_dict(source.config.raw)
        planned = plan_residency(
            plan,
            source.expert_bytes,
            source.expert_layers,
            args,
            forced=forced,
            context_tokens=context_tokens,
            model_context=source.config.context_length or 0,
            streams=family_streams_experts(source.config.model_type),
        )
    except OutOfMemoryBudget:
        return plan
    if planned.experts is not None and planned.experts.streamed:  # the estimate with this disk's own speed
        rate = disk_rate(str(source.path))
        planned.experts.speed_share = speed_share(planned.experts, planned.weights_bytes, rate)
    return planned


def describe_residency(plan: MemoryPlan, path: str = "") -> list[str]:
    """``inspect``'s lines on the experts: resident, slab, streamed bytes and the speed share."""
    from engine.runtime.memory import format_bytes

    r = plan.experts
    if r is None:
        return []
    if not r.streamed:
        return [f"  experts       {format_bytes(r.total_bytes)} of the weights, all resident ({r.experts} per layer)"]
    rate = _DISK_RATES.get(_device(path) or -1)
    where = f"a disk read at {format_bytes(rate)}/s measured" if rate else "an assumed SSD"
    return [
        f"  resident      {format_bytes(plan.weights_bytes - r.slab_bytes)} non-expert weights",
        f"  expert slab   {format_bytes(r.slab_bytes)}: {r.slots} of {r.experts} experts in each of {r.layers} layers",
        f"  streamed      {format_bytes(r.streamed_bytes)} of experts read from disk when routed",
        f"  speed         about {r.speed_share:.0%} of fully resident decoding (with {where})",
    ]


_DISK_RATES: dict[int, float] = {}


def disk_rate(path: str) -> float | None:
    """Random read rate of the disk holding ``path``'s weights, measured once per disk."""
    from pathlib import Path

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    largest = max(files, key=lambda f: f.stat().st_size)
    device = largest.stat().st_dev
    if device not in _DISK_RATES:
        try:
            _DISK_RATES[device] = measure_disk(str(largest), nbytes=32 << 20)[1]
        except OSError:
            return None
    return _DISK_RATES[device]


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def expert_layers(names: Any) -> int:
    """How many decoder layers hold routed experts among the stored ``names``."""
    return len({m.group(1) for n in names if is_routed_expert(n) and (m := _LAYER.search(n))})


def speed_share(residency: ExpertResidency | None, weights_bytes: int, disk_rate: float | None = None) -> float:
    """Expected share of fully resident decode speed: each token reads its experts that
    miss (about the non-resident share of them, routing taken as uniform) from disk on top
    of the resident pass."""
    if residency is None or not residency.streamed:
        return 1.0
    per_expert = residency.total_bytes / (residency.experts * residency.layers)
    active = weights_bytes - residency.slab_bytes + residency.layers * residency.top_k * per_expert
    resident_time = active / ASSUMED_MEMORY_RATE
    miss = 1 - residency.slots / residency.experts
    disk_time = miss * residency.layers * residency.top_k * per_expert / (disk_rate or ASSUMED_DISK_RATE)
    return resident_time / (resident_time + disk_time)


def stream_experts(
    model: Any, weights: dict[str, Any], headers: dict[str, Any], residency: ExpertResidency, name: str
) -> Any:
    """Give each MoE layer of ``model`` its slab in place of its stacked experts, in
    ``weights`` and on the module alike (before the tree is filled), and return the
    ExpertStore that fills the slabs; None when every expert stays resident."""
    import mlx.core as mx

    from engine.models.expert_sources import ByLayer, NoSource, expert_sources
    from engine.models.expert_store import ExpertStore
    from engine.models.switch import SwitchGLU

    if not residency.streamed:
        return None
    modules = dict(model.named_modules())
    glus = [(p, m) for p, m in modules.items() if isinstance(m, SwitchGLU) and not p.startswith("mtp")]
    glus.sort(key=lambda pm: [int(t) if t.isdigit() else 0 for t in pm[0].split(".")])
    files = sorted({str(info.file) for info in headers.values()})
    store = ExpertStore(files, residency.top_k)
    headers = ByLayer(headers)
    for path, glu in glus:
        params = {
            f"{proj}.{leaf}": weights[f"{path}.{proj}.{leaf}"]
            for proj in ("gate_proj", "up_proj", "down_proj")
            for leaf in glu[proj].parameters()
        }
        n = glu.gate_proj["weight"].shape[0]
        try:
            sources = expert_sources(path, params, n, headers)
        except NoSource as e:
            store.close()
            raise ModelLoadError(
                f"{name} stores its experts in a layout that cannot be read by parts ({e}); "
                "load it with every expert resident (--resident-experts 1) or convert it with mlx-lm"
            ) from None
        slots = min(residency.slots, n)
        for proj in ("gate_proj", "up_proj", "down_proj"):  # adapters on the experts check their count
            object.__setattr__(glu[proj], "stored_experts", n)
        for key, array in params.items():
            proj, leaf = key.split(".")
            slab = mx.zeros((slots, *array.shape[1:]), dtype=array.dtype)
            weights[f"{path}.{key}"] = slab
            glu[proj][leaf] = slab
        glu.streamed = store.add_layer(glu, n, slots, sources, _router_choice(modules, path))
    return store


def _router_choice(modules: dict[str, Any], path: str) -> Any:
    """``choose_experts`` of the nearest module above the experts at ``path`` that routes to
    them (the MoE block, or the decoder layer where the router sits beside the experts)."""
    while "." in path:
        path = path.rsplit(".", 1)[0]
        choose = getattr(modules.get(path), "choose_experts", None)
        if choose is not None:
            return choose
    return None


class _NoCompiledStep:
    """Stands in for the model's compiled decoder: a streamed layer reads the router's
    choice on the host mid-pass, which a compiled function cannot."""

    supported = False
    stack_only = False


def start_streaming(model: Any, store: Any, progress: Any = None) -> None:
    """Fill the slabs (``progress(done, total)`` by layer) and keep the store on the model
    (for its figures and its unload)."""
    store.warm(progress)
    for attr in ("_compiled_decoder", "_hybrid_decoder"):
        object.__setattr__(model, attr, _NoCompiledStep())
    object.__setattr__(model, "_expert_store", store)


def stop_streaming(model: Any) -> None:
    """Stop a streamed model's readers and close its files (it is being unloaded)."""
    store = expert_store(model)
    if store is not None:
        store.close()


def expert_store(model: Any) -> Any:
    return getattr(model, "_expert_store", None)


def expert_report(model: Any, plan: MemoryPlan | None) -> dict[str, Any] | None:
    """``--json``'s ``experts``: every expert's bytes, those resident, bytes read, hit rate."""
    residency = plan.experts if plan is not None else None
    if residency is None:
        return None
    store = expert_store(model)
    if store is None:
        return {
            "total_bytes": residency.total_bytes,
            "resident_bytes": residency.total_bytes,
            "read_bytes": 0,
            "hit_rate": 1.0,
        }
    return {
        "total_bytes": residency.total_bytes,
        "resident_bytes": store.slab_bytes,
        "read_bytes": store.stats.read_bytes,
        "hit_rate": round(store.stats.hit_rate, 6),
    }


def measure_disk(file: str, nbytes: int = 64 << 20, block: int = 1 << 20) -> tuple[float, float]:
    """The disk's (sequential, random) read rates in bytes/s over ``file``, dd-style: the
    range is dropped from the page cache first (where the system allows), then read in
    ``block``-sized reads, in order and then in shuffled order of other blocks."""
    size = os.path.getsize(file)
    nbytes = max(block, min(nbytes, size // 2 // block * block))
    fd = os.open(file, os.O_RDONLY)
    try:
        seq = _timed_reads(fd, [i * block for i in range(nbytes // block)], block)
        count = nbytes // block
        span = max(1, (size - block) // block)
        import random

        rng = random.Random(0)
        offsets = [rng.randrange(span) * block for _ in range(count)]
        rnd = _timed_reads(fd, offsets, block)
    finally:
        os.close(fd)
    return seq, rnd


def _timed_reads(fd: int, offsets: list[int], block: int) -> float:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        for offset in offsets:
            advise(fd, offset, block, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    total = 0
    for offset in offsets:
        total += len(os.pread(fd, block, offset))
    elapsed = time.perf_counter() - start
    return total / elapsed if elapsed > 0 else math.inf
