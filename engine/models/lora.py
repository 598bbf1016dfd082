"""LoRA and DoRA adapters mounted onto a loaded model at runtime.

Mounting wraps each targeted linear layer (``nn.Linear`` or ``nn.QuantizedLinear``; a quantized
base stays quantized) in a ``LoRAHost`` that keeps the original layer and the low-rank deltas of
every mounted adapter; a stacked expert projection (``SwitchLinear``) takes mlx-lm's
``LoRASwitchLinear`` deltas (``lora_a`` [experts, r, in], ``lora_b`` [experts, out, r]) in a
``SwitchLoRAHost``. Which adapters act, and how strongly, is switched with ``activate`` without
touching the base weights; ``unmount`` puts the original layer object back once no adapter is
left on it, so the model computes exactly what it computed before.

The two adapter file formats (mlx-lm's and PEFT's) are read by ``engine.models.lora_files``.

How adapters combine: every active adapter contributes its own change of the layer's output,
computed against the base layer alone, multiplied by its scale multiplier; the changes add up.
For LoRA the change is ``mult * s * (x @ a) @ b``, so the multiplier scales the adapter linearly.
For DoRA the adapter's output is ``g * (W x + s * B A x) + bias`` with
``g = m / ||W + s * B A||_row`` (the norm over the weight combined with this adapter only); its
change is that minus the base output, times the multiplier (multiplier 0 is the base, 1 is the
adapter as trained). This equals PEFT with the DoRA adapter first in the active list; PEFT
applies later adapters to a running sum, which makes its result order-dependent.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.errors import AdapterError
from engine.models.expert_linear import QuantizedSwitchLinear, SwitchLinear
from engine.models.lora_files import (
    MAX_MULTIPLIER,
    AdapterFormat,
    AdapterKind,
    Delta,
    ParsedAdapter,
    parse_folder,
)


@dataclass
class MountedAdapter:
    """What a mounted adapter is, for menus, signatures and error messages."""

    name: str
    path: str
    format: AdapterFormat
    kind: AdapterKind
    rank: int
    targets: list[str]  # module paths, e.g. model.layers.0.self_attn.q_proj
    digest: str  # sha256 of the weights file: tells two adapters of one name apart
    base_model: str | None = None  # what the adapter says it was trained on, if it says


class _Deltas:
    """Plain holder so MLX's module tree does not treat the adapters as model parameters."""

    def __init__(self) -> None:
        self.by_name: dict[str, Delta] = {}
        self.active: list[tuple[Delta, float]] = []


class LoRAHost(nn.Module):
    """A linear layer with any number of mounted low-rank adapters, some of them active."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self._deltas = _Deltas()

    @property
    def adapter_names(self) -> list[str]:
        return list(self._deltas.by_name)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        if not self._deltas.active:
            return y
        out = y
        for delta, mult in self._deltas.active:
            out = out + _delta_output(self.base, delta, x, y, mult)
        return out


class SwitchLoRAHost(LoRAHost):
    """A stacked expert projection (``SwitchLinear``) with adapters in mlx-lm's
    ``LoRASwitchLinear`` format: expert e's change is ``s * (x @ a[e]) @ b[e]``, held as
    a [E, in, r] and b [E, r, out] (one ``gather_mm`` each). When the experts stream from
    disk the layer's indices are slab slots; the streamed layer then sets ``slot_experts``
    (the expert in each slot) and the deltas, resident whole, are gathered by expert."""

    slot_experts: mx.array | None = None

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self.with_deltas(self.base(x, indices, sorted_indices), x, indices, sorted_indices)

    def with_deltas(self, y: mx.array, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """``y``, the base layer's output for ``x``, plus every active adapter's change (a
        stack of expert layers computes its layers' base outputs together, then adds these)."""
        experts = indices if self.slot_experts is None else self.slot_experts[indices]
        out = y
        for d, mult in self._deltas.active:
            low = _gather_mm(_gather_mm(x, d.a, experts, sorted_indices), d.b, experts, sorted_indices)
            out = out + (mult * d.scale * low).astype(y.dtype)
        return out


def _gather_mm(x: mx.array, w: mx.array, experts: mx.array, sorted_indices: bool) -> mx.array:
    if mx.default_device() == mx.cpu and (x.dtype != mx.float32 or w.dtype != mx.float32):
        x, w = x.astype(mx.float32), w.astype(mx.float32)  # MLX's CPU gather_mm: float32 only
    return mx.gather_mm(x, w, rhs_indices=experts, sorted_indices=sorted_indices)


def _delta_output(base: nn.Module, d: Delta, x: mx.array, y: mx.array, mult: float) -> mx.array:
    low = (x @ d.a) @ d.b
    if d.b_bias is not None:
        low = low + d.b_bias
    lora = d.scale * low
    if d.dora_gain is None:
        return (mult * lora).astype(y.dtype)
    plain = y - base.bias if "bias" in base else y
    gain = d.dora_gain
    change = (gain - 1.0) * plain + gain * lora
    return (mult * change).astype(y.dtype)


# ---- reading adapter folders ------------------------------------------------------------


# ---- finding and checking target layers --------------------------------------------------


def _resolve(model: nn.Module, path: str) -> tuple[object, str | int, nn.Module] | None:
    """(parent container, key in it, module) for a dotted path, or None when it does not exist."""
    parent: object = None
    key: str | int = ""
    node: object = model
    for part in path.split("."):
        parent = node
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return None
            key, node = int(part), node[int(part)]
        elif isinstance(node, dict) and part in node:
            key, node = part, node[part]
        else:
            return None
    if not isinstance(node, nn.Module):
        return None
    return parent, key, node


def _set_child(parent: object, key: str | int, module: nn.Module) -> None:
    if isinstance(parent, list):
        parent[key] = module  # type: ignore[index]
    else:
        setattr(parent, key, module)  # nn.Module keeps children in its dict


def _dims(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear or quantized linear layer (of each expert, for stacked ones)."""
    out_dims, packed = layer.weight.shape[-2:]
    if isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return packed * 32 // layer.bits, out_dims
    return packed, out_dims


def _base_weight(layer: nn.Module) -> mx.array:
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(
            layer.weight,
            layer.scales,
            layer.get("biases"),
            group_size=layer.group_size,
            bits=layer.bits,
            mode=getattr(layer, "mode", "affine"),
        )
    return layer.weight


def _natural(path: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _find(model: nn.Module, path: str, unread: Mapping[str, nn.Module]) -> tuple[object, str | int, nn.Module] | None:
    """``_resolve`` in the model, else in a part of it set apart unread (``unread``: its name on
    the model -> its module, e.g. a built-in MTP layer read only when drafting asks for it)."""
    found = _resolve(model, path)
    if found is None and path.split(".", 1)[0] in unread:
        found = _resolve(dict(unread), path)
    return found


def _model_path(model: nn.Module, path: str, unread: Mapping[str, nn.Module]) -> str:
    """The module path in this model: as written, as the family places it (``adapter_module``), or
    renamed the way the family renames checkpoint weights (e.g. a multimodal wrapper's
    ``language_model.model.`` prefix)."""
    if _find(model, path, unread) is not None:
        return path
    moved = _family_path(model, path)
    if moved is not None and _find(model, moved, unread) is not None:
        return moved
    if not hasattr(model, "sanitize"):
        return path
    # A family's sanitize may build a module the names call for (Qwen3.5 its MTP layer, with
    # random weights): the probe must leave the model as it was.
    before = set(model)
    try:
        renamed = list(model.sanitize({path + ".weight": mx.zeros((1, 1))}))
    except Exception:  # a family's sanitize may expect real checkpoint shapes; keep the path as given
        renamed = []
    finally:
        for added in set(model) - before:
            del model[added]
    if len(renamed) == 1 and renamed[0].endswith(".weight"):
        candidate = renamed[0][: -len(".weight")]
        if _find(model, candidate, unread) is not None:
            return candidate
    return path


def _family_path(model: nn.Module, path: str) -> str | None:
    """The family's own answer (its ``adapter_module``) for a name that sanitize's renaming of a
    lone tensor cannot place: DeepSeek V3's and GLM-5's MTP layer, stored as one more layer."""
    rule = getattr(model, "adapter_module", None)
    return rule(path) if callable(rule) else None


def _check_target(
    model: nn.Module, path: str, delta: Delta, parsed: ParsedAdapter, name: str, unread: Mapping[str, nn.Module]
) -> nn.Module:
    found = _find(model, path, unread)
    hint = f" ({parsed.base_model}?)" if parsed.base_model else ""
    if found is None and (_family_path(model, path) or "").startswith("mtp."):
        raise AdapterError(
            f"adapter '{name}' targets {path}, in the built-in MTP layer, which this model's weights do not hold "
            f"(mlx-lm's conversions drop it): mount it on the original checkpoint{hint}"
        )
    if found is None:
        raise AdapterError(
            f"adapter '{name}' targets {path}, which this model does not have: "
            f"it was trained for a different architecture{hint}"
        )
    layer = found[2]
    base = layer.base if isinstance(layer, LoRAHost) else layer
    stacked = isinstance(base, (SwitchLinear, QuantizedSwitchLinear))
    if not isinstance(base, (nn.Linear, nn.QuantizedLinear)) and not stacked:
        raise AdapterError(
            f"adapter '{name}' targets {path}, a {type(base).__name__}; only linear layers take adapters"
        )
    if stacked != (delta.a.ndim == 3):
        what = "stacked experts" if stacked else "one linear layer"
        raise AdapterError(
            f"adapter '{name}' does not match {path} ({what}): it was trained for a different model{hint}"
        )
    in_dims, out_dims = _dims(base)
    want_in, want_out = delta.a.shape[-2], delta.b.shape[-1]
    # A streamed layer's stack holds slab slots; ``stored_experts`` says how many experts it has.
    experts = getattr(base, "stored_experts", base.weight.shape[0]) if stacked else 0
    if stacked and delta.a.shape[0] != experts:
        raise AdapterError(f"adapter '{name}' has {delta.a.shape[0]} experts for {path}, the model {experts}{hint}")
    if (want_in, want_out) != (in_dims, out_dims):
        raise AdapterError(
            f"adapter '{name}' expects {_short(path)} {want_in}->{want_out} but the model has "
            f"{in_dims}->{out_dims} at {path}: this adapter was trained for a different base model{hint}"
        )
    for extra, label in ((delta.magnitude, "magnitude"), (delta.b_bias, "lora_B bias")):
        if extra is not None and extra.shape != (out_dims,):
            raise AdapterError(
                f"adapter '{name}' has a {label} of shape {tuple(extra.shape)} for {path}, expected ({out_dims},)"
            )
    return base


def _to_compute_dtype(d: Delta, base: nn.Module) -> None:
    """Store the adapter in the dtype the layer computes in, so no cast runs per token."""
    dtype = (base.scales if "scales" in base else base.weight).dtype
    if not mx.issubdtype(dtype, mx.floating):
        return
    for attr in ("a", "b", "b_bias", "dora_gain"):
        value = getattr(d, attr)
        if value is not None:
            setattr(d, attr, value.astype(dtype))
    mx.eval([v for v in (d.a, d.b, d.b_bias, d.dora_gain) if v is not None])


def _dora_gain(base: nn.Module, d: Delta) -> mx.array:
    weight = _base_weight(base).astype(mx.float32)
    adapted = weight + d.scale * (d.b.astype(mx.float32).T @ d.a.astype(mx.float32).T)
    return d.magnitude.astype(mx.float32) / mx.linalg.norm(adapted, axis=1)


# ---- the public operations ---------------------------------------------------------------


class AdapterSet:
    """The adapters mounted on one model and which of them are active with what multiplier."""

    def __init__(self) -> None:
        self.mounted: dict[str, MountedAdapter] = {}
        self.active: dict[str, float] = {}
        # Per adapter, the deltas of layers in a part of the model set apart unread when it was
        # mounted: module path -> (delta, kind), put in place by ``mount_waiting`` once it is read.
        self.waiting: dict[str, dict[str, tuple[Delta, AdapterKind]]] = {}


def adapter_set(model: nn.Module) -> AdapterSet:
    """The model's adapter bookkeeping (created empty on first use)."""
    found = getattr(model, "_adapter_set", None)
    if found is None:
        found = AdapterSet()
        object.__setattr__(model, "_adapter_set", found)
    return found


def _hosts(model: nn.Module) -> dict[str, LoRAHost]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRAHost)}


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def mount(
    model: nn.Module,
    adapter_dir: str | Path,
    name: str | None = None,
    *,
    unread: Mapping[str, nn.Module] | None = None,
) -> MountedAdapter:
    """Read an adapter folder and attach it to ``model`` (inactive until ``activate``).

    ``unread`` names parts of the model set apart with their weights not yet read (its name on
    the model -> the module, built as it will be: a built-in MTP layer). Targets inside one are
    checked against it now and mounted by ``mount_waiting`` once it is on the model, with its
    real weights (a DoRA gain reads them), as if it had been loaded with the model."""
    unread = unread or {}
    folder = Path(adapter_dir).expanduser()
    name = name or folder.resolve().name
    state = adapter_set(model)
    if name in state.mounted:
        raise AdapterError(f"an adapter named '{name}' is already mounted; unmount it or pick another name")
    if not name or any(c in name for c in ";=@\n"):
        raise AdapterError(f"adapter name '{name}' is empty or has one of ; = @ in it; pick a plain name")
    parsed = parse_folder(folder)
    if not parsed.deltas:
        raise AdapterError(f"{parsed.weights_file} holds no LoRA tensors; there is nothing to mount")
    # Check every target before changing anything, so a refused adapter leaves the model as it was.
    spelled: dict[str, str] = {}  # module path here -> as the adapter names it
    for p in list(parsed.deltas):
        here = _model_path(model, p, unread)
        if here in spelled:  # e.g. the MTP layer both as model.layers.N and as mtp
            raise AdapterError(f"adapter '{name}' names {here} twice, as {spelled[here]} and as {p}; keep one")
        spelled[here] = p
    parsed.deltas = {here: parsed.deltas[p] for here, p in spelled.items()}
    paths = sorted(parsed.deltas, key=_natural)  # report the first mismatch in model order
    for path in paths:
        _check_target(model, path, parsed.deltas[path], parsed, name, unread)
    for path, delta in parsed.deltas.items():
        if _resolve(model, path) is None:  # in a part not read yet
            state.waiting.setdefault(name, {})[path] = (delta, parsed.kind)
        else:
            _put_in_place(model, path, delta, parsed.kind, name)
    info = MountedAdapter(
        name=name,
        path=str(folder),
        format=parsed.format,
        kind=parsed.kind,
        rank=parsed.rank,
        targets=paths,
        digest=_file_digest(parsed.weights_file),
        base_model=parsed.base_model,
    )
    state.mounted[name] = info
    return info


def _put_in_place(model: nn.Module, path: str, delta: Delta, kind: AdapterKind, name: str) -> None:
    """Wrap the layer at ``path`` in a LoRAHost (once) and add the adapter's delta to it."""
    parent, key, layer = _resolve(model, path)  # type: ignore[misc]
    base = layer.base if isinstance(layer, LoRAHost) else layer
    if kind == "dora":
        delta.dora_gain = _dora_gain(base, delta)
    _to_compute_dtype(delta, base)
    if not isinstance(layer, LoRAHost):
        layer = SwitchLoRAHost(layer) if isinstance(layer, (SwitchLinear, QuantizedSwitchLinear)) else LoRAHost(layer)
        _set_child(parent, key, layer)
    layer._deltas.by_name[name] = delta


def mount_waiting(model: nn.Module) -> int:
    """Mount the targets adapters hold for a part of the model that was set apart unread when
    they were mounted and is on the model now (``mount``'s ``unread``), in the order the
    adapters were mounted, with their active multipliers. Returns how many layers took one."""
    state = adapter_set(model)
    placed = 0
    for name, held in state.waiting.items():
        for path in [p for p in held if _resolve(model, p) is not None]:
            delta, kind = held.pop(path)
            _put_in_place(model, path, delta, kind, name)
            placed += 1
    state.waiting = {n: held for n, held in state.waiting.items() if held}
    if placed:
        _apply(model, state)
    return placed


def activate(model: nn.Module, scales: dict[str, float]) -> None:
    """Make exactly these mounted adapters active, each with its scale multiplier (1.0 = as trained)."""
    state = adapter_set(model)
    unknown = [n for n in scales if n not in state.mounted]
    if unknown:
        have = ", ".join(state.mounted) or "none"
        raise AdapterError(f"adapter '{unknown[0]}' is not mounted (mounted: {have}); mount it first")
    for n, s in scales.items():
        if not math.isfinite(float(s)):
            raise AdapterError(f"adapter '{n}' got scale {s}; use a finite number such as 1.0")
        if abs(float(s)) > MAX_MULTIPLIER:
            raise AdapterError(
                f"adapter '{n}' got scale {float(s):g}; use a multiplier from -{MAX_MULTIPLIER:g} to "
                f"{MAX_MULTIPLIER:g} (1.0 is the adapter as trained)"
            )
    state.active = {n: float(s) for n, s in scales.items()}
    _apply(model, state)


def deactivate(model: nn.Module, names: list[str] | None = None) -> None:
    """Deactivate the named adapters (all when ``names`` is None); they stay mounted."""
    state = adapter_set(model)
    state.active = {} if names is None else {n: s for n, s in state.active.items() if n not in names}
    _apply(model, state)


def unmount(model: nn.Module, name: str) -> None:
    """Remove an adapter; layers left without adapters get their original module back."""
    state = adapter_set(model)
    if name not in state.mounted:
        have = ", ".join(state.mounted) or "none"
        raise AdapterError(f"adapter '{name}' is not mounted (mounted: {have})")
    state.active.pop(name, None)
    state.waiting.pop(name, None)
    for path, host in _hosts(model).items():
        host._deltas.by_name.pop(name, None)
        if not host._deltas.by_name:
            parent, key, _ = _resolve(model, path)  # type: ignore[misc]
            _set_child(parent, key, host.base)
    del state.mounted[name]
    _apply(model, state)


def mounted(model: nn.Module) -> list[MountedAdapter]:
    return list(adapter_set(model).mounted.values())


def active_adapters(model: nn.Module) -> dict[str, float]:
    return dict(adapter_set(model).active)


def active_signature(model: nn.Module) -> str:
    """A stable key of what the active adapters compute; "" when none is active.

    The KV prefix cache stores it with cached tokens: text cached under one adapter set is never
    reused under another. It names each adapter with its weights' digest and multiplier, so
    remounting different weights under the same name also changes it.
    """
    state = adapter_set(model)
    parts = [
        f"{n}@{state.mounted[n].digest[:16]}={state.active[n]!r}"
        for n in sorted(state.active)
        if state.active[n] != 0.0
    ]
    return ";".join(parts)


def _apply(model: nn.Module, state: AdapterSet) -> None:
    # A fixed order keeps float sums reproducible; a zero multiplier changes nothing, so skip it.
    order = [n for n in sorted(state.active) if state.active[n] != 0.0]
    for host in _hosts(model).values():
        by_name = host._deltas.by_name
        host._deltas.active = [(by_name[n], state.active[n]) for n in order if n in by_name]
