"""LoRA and DoRA adapters mounted onto a loaded model at runtime.

Mounting wraps each targeted linear layer (``nn.Linear`` or ``nn.QuantizedLinear``; a quantized
base stays quantized) in a ``LoRAHost`` that keeps the original layer and the low-rank deltas of
every mounted adapter; a stacked expert projection (``SwitchLinear``) takes mlx-lm's
``LoRASwitchLinear`` deltas (``lora_a`` [experts, r, in], ``lora_b`` [experts, out, r]) in a
``SwitchLoRAHost``. Which adapters act, and how strongly, is switched with ``activate`` without
touching the base weights; ``unmount`` puts the original layer object back once no adapter is
left on it, so the model computes exactly what it computed before.

Two file formats are read:

* mlx-lm: ``adapter_config.json`` (``fine_tune_type`` lora|dora, ``lora_parameters.scale``) and
  ``adapters.safetensors`` with ``<path>.lora_a`` [in, r], ``<path>.lora_b`` [r, out] and, for
  DoRA, ``<path>.m`` [out]. The update is ``scale * (x @ a) @ b``; mlx-lm ignores ``alpha``.
* PEFT: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``use_dora``,
  ``rank_pattern``, ``alpha_pattern``) and ``adapter_model.safetensors`` with
  ``base_model.model.<path>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r] (and
  ``lora_B.bias`` with ``lora_bias``) and ``lora_magnitude_vector`` [out]. The scaling is
  ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.

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
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from engine.errors import AdapterError, ModelLoadError
from engine.files import SETTINGS_LIMIT, read_text_bounded
from engine.models.switch import QuantizedSwitchLinear, SwitchLinear

AdapterFormat = Literal["mlx-lm", "peft"]
AdapterKind = Literal["lora", "dora"]


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


@dataclass
class _Delta:
    """One adapter's low-rank update of one layer."""

    a: mx.array  # [in, r]
    b: mx.array  # [r, out]
    scale: float
    magnitude: mx.array | None = None  # DoRA: [out]
    b_bias: mx.array | None = None  # PEFT lora_bias: [out]
    dora_gain: mx.array | None = None  # DoRA: m / ||W + s B A||, computed once at mount


class _Deltas:
    """Plain holder so MLX's module tree does not treat the adapters as model parameters."""

    def __init__(self) -> None:
        self.by_name: dict[str, _Delta] = {}
        self.active: list[tuple[_Delta, float]] = []


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
        y = self.base(x, indices, sorted_indices)
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


def _delta_output(base: nn.Module, d: _Delta, x: mx.array, y: mx.array, mult: float) -> mx.array:
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


@dataclass
class _Parsed:
    format: AdapterFormat
    kind: AdapterKind
    deltas: dict[str, _Delta]  # module path -> delta
    rank: int
    weights_file: Path
    base_model: str | None = None
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(read_text_bounded(path, SETTINGS_LIMIT, "an adapter's settings", AdapterError))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {path}: {exc}; the adapter folder looks damaged") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path} is not a JSON object; the adapter folder looks damaged")
    return data


# An adapter's own scale (mlx-lm's lora_parameters.scale, PEFT's alpha / r) is about 1-64 in
# practice; a multiplier (how strongly a mounted adapter acts) is about 0-2. Far past either,
# the model's output is noise or infinity, so such numbers are refused as damage or typos.
MAX_ADAPTER_SCALE = 1e4
MAX_MULTIPLIER = 100.0


def _number(value: object, what: str, where: Path, *, low: float, high: float) -> float:
    """A finite number within [low, high] from an adapter's config, or a one-line refusal."""
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and low <= number <= high):
        raise AdapterError(
            f"{where} says {what} is {value!r}; it must be a number from {low:g} to {high:g}: "
            "the adapter's config is damaged"
        )
    return number


def _rank(value: object, what: str, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{where} says {what} is {value!r}; a LoRA rank is a whole number of at least 1")
    return value


def _load_safetensors(path: Path) -> dict[str, mx.array]:
    from engine.artifacts.weights import read_header

    try:
        read_header(path)  # a bounded header read: refuses a truncated or foreign file in one line
    except ModelLoadError as exc:
        raise AdapterError(f"{exc} (the adapter weights look damaged)") from None
    try:
        return dict(mx.load(str(path)))
    except Exception as exc:  # MLX raises plain RuntimeError/ValueError for bad files
        raise AdapterError(f"cannot read {path}: {exc}; the adapter weights look damaged") from None


def _base_hint(value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    return value.rstrip("/").split("/")[-1]


def _parse_folder(folder: Path) -> _Parsed:
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist; pick a folder with adapter_config.json")
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no adapter_config.json; it is not an mlx-lm or PEFT adapter folder")
    config = _read_json(config_path)
    if (folder / "adapters.safetensors").is_file():
        return _parse_mlxlm(folder, config)
    if (folder / "adapter_model.safetensors").is_file():
        return _parse_peft(folder, config)
    if (folder / "adapter_model.bin").is_file():
        raise AdapterError(
            f"{folder} holds adapter_model.bin (pickle), which is never loaded; convert it to adapter_model.safetensors"
        )
    raise AdapterError(f"{folder} has no adapters.safetensors (mlx-lm) or adapter_model.safetensors (PEFT)")


def _parse_mlxlm(folder: Path, config: dict) -> _Parsed:
    kind = config.get("fine_tune_type") or ("dora" if config.get("use_dora") else "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{folder} is a '{kind}' fine-tune, not a LoRA/DoRA adapter; load it as a model instead")
    params = config.get("lora_parameters") or {}
    if "scale" not in params:
        raise AdapterError(f"{folder}/adapter_config.json has no lora_parameters.scale; re-save it with mlx-lm")
    config_file = folder / "adapter_config.json"
    scale = _number(
        params["scale"], "lora_parameters.scale", config_file, low=-MAX_ADAPTER_SCALE, high=MAX_ADAPTER_SCALE
    )
    declared_rank = _rank(params["rank"], "lora_parameters.rank", config_file) if "rank" in params else None
    weights_file = folder / "adapters.safetensors"
    weights = _load_safetensors(weights_file)
    groups: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        path, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m") or not path:
            raise AdapterError(
                f"{weights_file.name} holds '{key}', which is not a LoRA tensor (lora_a, lora_b, m); "
                "full or embedding fine-tunes cannot be mounted"
            )
        groups.setdefault(path, {})[leaf] = value
    deltas: dict[str, _Delta] = {}
    rank = 0
    for path, parts in groups.items():
        if "lora_a" not in parts or "lora_b" not in parts:
            raise AdapterError(f"{weights_file.name} lacks lora_a or lora_b for {path}; the file is incomplete")
        if kind == "dora" and "m" not in parts:
            raise AdapterError(f"{weights_file.name} is a DoRA adapter without the magnitude '{path}.m'")
        a, b = parts["lora_a"], parts["lora_b"]
        if a.ndim == 3 and b.ndim == 3:  # stacked experts (LoRASwitchLinear): [E, r, in], [E, out, r]
            if kind != "lora":
                raise AdapterError(f"{path}: DoRA on stacked experts cannot be mounted; use a LoRA adapter")
            a, b = a.swapaxes(-1, -2), b.swapaxes(-1, -2)
        if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
            raise AdapterError(
                f"{path}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not chain; the file is damaged"
            )
        if declared_rank is not None and a.shape[-1] != declared_rank:
            raise AdapterError(
                f"{path}: lora_a has rank {a.shape[-1]} but adapter_config.json says rank {declared_rank}; "
                "the config and the weights are from different adapters"
            )
        rank = max(rank, a.shape[-1])
        deltas[path] = _Delta(a=a, b=b, scale=scale, magnitude=parts.get("m") if kind == "dora" else None)
    return _Parsed("mlx-lm", kind, deltas, rank, weights_file, _base_hint(config.get("model")))


_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<path>.+?)\.(?P<leaf>lora_A|lora_B|lora_magnitude_vector)"
    r"(?:\.(?!(?:weight|bias)$)[\w\-]+)?"  # an adapter name some savers leave in
    r"(?:\.(?P<param>weight|bias))?$"
)


def _pattern_value(patterns: dict, path: str, default: float) -> float:
    # PEFT matches a pattern key against the end of the module path, on a dot boundary.
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _parse_peft(folder: Path, config: dict) -> _Parsed:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{folder} is a PEFT '{peft_type}' adapter; only LoRA and DoRA can be mounted")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{folder} also replaces whole modules ({', '.join(config['modules_to_save'])}); "
            "such adapters cannot be toggled at runtime"
        )
    kind: AdapterKind = "dora" if config.get("use_dora") else "lora"
    rslora = bool(config.get("use_rslora"))
    config_file = folder / "adapter_config.json"
    declared_rank = _rank(config.get("r", 8), "r", config_file)
    alpha = _number(config.get("lora_alpha", declared_rank), "lora_alpha", config_file, low=-1e6, high=1e6)
    for key, value in (config.get("rank_pattern") or {}).items():
        _rank(value, f"rank_pattern[{key!r}]", config_file)
    for key, value in (config.get("alpha_pattern") or {}).items():
        _number(value, f"alpha_pattern[{key!r}]", config_file, low=-1e6, high=1e6)
    weights_file = folder / "adapter_model.safetensors"
    weights = _load_safetensors(weights_file)
    groups: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise AdapterError(
                f"{weights_file.name} holds '{key}', which is not a LoRA tensor; "
                "embedding LoRA and extra trained modules cannot be mounted"
            )
        leaf = match["leaf"] + ("." + match["param"] if match["param"] else "")
        groups.setdefault(match["path"], {})[leaf] = value
    deltas: dict[str, _Delta] = {}
    rank = 0
    for path, parts in groups.items():
        a_t, b_t = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if a_t is None or b_t is None:
            raise AdapterError(f"{weights_file.name} lacks lora_A or lora_B for {path}; the file is incomplete")
        if a_t.ndim != 2 or b_t.ndim != 2 or a_t.shape[0] != b_t.shape[1]:
            raise AdapterError(
                f"{path}: lora_A {tuple(a_t.shape)} and lora_B {tuple(b_t.shape)} do not chain; the file is damaged"
            )
        r = a_t.shape[0]
        expected = _pattern_value(config.get("rank_pattern"), path, declared_rank)
        if r != expected:
            raise AdapterError(
                f"{path}: lora_A has rank {r} but adapter_config.json says r={expected}; "
                "the config and the weights are from different adapters"
            )
        rank = max(rank, r)
        a_val = _pattern_value(config.get("alpha_pattern"), path, alpha)
        scale = a_val / math.sqrt(r) if rslora else a_val / r
        if abs(scale) > MAX_ADAPTER_SCALE:
            raise AdapterError(
                f"{config_file} gives {path} a scale of {scale:g} (lora_alpha / r); more than "
                f"{MAX_ADAPTER_SCALE:g} turns the model's output into noise: the config is damaged"
            )
        magnitude = parts.get("lora_magnitude_vector", parts.get("lora_magnitude_vector.weight"))
        if kind == "dora" and magnitude is None:
            raise AdapterError(f"{weights_file.name} is a DoRA adapter without lora_magnitude_vector for {path}")
        deltas[path] = _Delta(a=a_t.T, b=b_t.T, scale=scale, magnitude=magnitude, b_bias=parts.get("lora_B.bias"))
    return _Parsed("peft", kind, deltas, rank, weights_file, _base_hint(config.get("base_model_name_or_path")))


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
    model: nn.Module, path: str, delta: _Delta, parsed: _Parsed, name: str, unread: Mapping[str, nn.Module]
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


def _to_compute_dtype(d: _Delta, base: nn.Module) -> None:
    """Store the adapter in the dtype the layer computes in, so no cast runs per token."""
    dtype = (base.scales if "scales" in base else base.weight).dtype
    if not mx.issubdtype(dtype, mx.floating):
        return
    for attr in ("a", "b", "b_bias", "dora_gain"):
        value = getattr(d, attr)
        if value is not None:
            setattr(d, attr, value.astype(dtype))
    mx.eval([v for v in (d.a, d.b, d.b_bias, d.dora_gain) if v is not None])


def _dora_gain(base: nn.Module, d: _Delta) -> mx.array:
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
        self.waiting: dict[str, dict[str, tuple[_Delta, AdapterKind]]] = {}


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
    parsed = _parse_folder(folder)
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


def _put_in_place(model: nn.Module, path: str, delta: _Delta, kind: AdapterKind, name: str) -> None:
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
