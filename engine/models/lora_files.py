"""Reading an adapter folder: its config and weights into one low-rank delta per layer.

Two file formats are read:

* mlx-lm: ``adapter_config.json`` (``fine_tune_type`` lora|dora, ``lora_parameters.scale``) and
  ``adapters.safetensors`` with ``<path>.lora_a`` [in, r], ``<path>.lora_b`` [r, out] and, for
  DoRA, ``<path>.m`` [out]. The update is ``scale * (x @ a) @ b``; mlx-lm ignores ``alpha``.
* PEFT: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``use_dora``,
  ``rank_pattern``, ``alpha_pattern``) and ``adapter_model.safetensors`` with
  ``base_model.model.<path>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r] (and
  ``lora_B.bias`` with ``lora_bias``) and ``lora_magnitude_vector`` [out]. The scaling is
  ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.

Every number an adapter's config gives is checked (finite, in range) and every refusal is one
line that names the file; the weights' header is read bounded before MLX loads them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import mlx.core as mx

from engine.errors import AdapterError, ModelLoadError
from engine.files import SETTINGS_LIMIT, read_text_bounded

AdapterFormat = Literal["mlx-lm", "peft"]
AdapterKind = Literal["lora", "dora"]


@dataclass
class Delta:
    """One adapter's low-rank update of one layer."""

    a: mx.array  # [in, r]
    b: mx.array  # [r, out]
    scale: float
    magnitude: mx.array | None = None  # DoRA: [out]
    b_bias: mx.array | None = None  # PEFT lora_bias: [out]
    dora_gain: mx.array | None = None  # DoRA: m / ||W + s B A||, computed once at mount


@dataclass
class ParsedAdapter:
    format: AdapterFormat
    kind: AdapterKind
    deltas: dict[str, Delta]  # module path -> delta
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


def parse_folder(folder: Path) -> ParsedAdapter:
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


def _parse_mlxlm(folder: Path, config: dict) -> ParsedAdapter:
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
    deltas: dict[str, Delta] = {}
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
        deltas[path] = Delta(a=a, b=b, scale=scale, magnitude=parts.get("m") if kind == "dora" else None)
    return ParsedAdapter("mlx-lm", kind, deltas, rank, weights_file, _base_hint(config.get("model")))


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


def _parse_peft(folder: Path, config: dict) -> ParsedAdapter:
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
    deltas: dict[str, Delta] = {}
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
        deltas[path] = Delta(a=a_t.T, b=b_t.T, scale=scale, magnitude=magnitude, b_bias=parts.get("lora_B.bias"))
    return ParsedAdapter("peft", kind, deltas, rank, weights_file, _base_hint(config.get("base_model_name_or_path")))
