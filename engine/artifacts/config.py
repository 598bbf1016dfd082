"""One normalised view of a model folder's config.json and generation_config.json.

Checkpoints spell the same facts several ways (``rope_scaling``/``rope_theta`` versus
the newer ``rope_parameters``; ``quantization`` versus ``quantization_config``; an int or
a list for ``eos_token_id``). Everything downstream reads ``ModelConfig`` and never the
raw files, so the spellings are settled here once, and the values that cannot mean
anything (a negative epsilon, a RoPE base of 0, a NaN temperature) are refused here too,
by config_values.py, before anything is built from them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.artifacts.config_spellings import normalise_rope, text_config_or_none
from engine.artifacts.config_values import check_generation_settings, check_model_settings
from engine.errors import ModelLoadError
from engine.files import SETTINGS_LIMIT, read_text_bounded

# generation_config.json keys that become default sampling settings.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")

# Keys that name a model's context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx")


@dataclass
class QuantizationSpec:
    """MLX quantization (affine, mxfp4, mxfp8, nvfp4) as mlx-lm writes it into config.json.

    ``overrides`` maps a module path (``model.layers.0.mlp.down_proj``) to its own
    ``{"bits", "group_size", "mode"}`` or to ``False`` when that module stays unquantized.
    """

    bits: int
    group_size: int
    mode: str = "affine"
    overrides: dict[str, dict[str, Any] | bool] = field(default_factory=dict)

    def params_for(self, module_path: str) -> dict[str, Any] | None:
        """The to_quantized() arguments for one module, or None when it is left as is.

        A module's own entry replaces the default whole (what it leaves out takes
        ``to_quantized``'s defaults: affine, that mode's bits and group size), as in mlx-lm.
        """
        from engine.artifacts.mlx_quant import module_params

        override = next((self.overrides[p] for p in _spellings(module_path) if p in self.overrides), True)
        if override is False:
            return None
        return module_params(override, {"bits": self.bits, "group_size": self.group_size, "mode": self.mode})

    def describe(self) -> str:
        text = f"{self.bits}-bit g{self.group_size}"
        if self.mode != "affine":
            text = f"{self.mode} {text}"
        if any(isinstance(v, dict) for v in self.overrides.values()):
            text += " (mixed)"
        return text

    def to_dict(self) -> dict[str, Any]:
        block: dict[str, Any] = {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}
        block.update(self.overrides)
        return block


@dataclass
class ModelConfig:
    model_type: str
    raw: dict[str, Any]  # normalised config.json, handed to the family's ModelArgs.from_dict
    text: dict[str, Any]  # the language model's part: raw["text_config"] for multimodal wrappers
    quantization: QuantizationSpec | None = None
    foreign_quantization: str | None = None  # a quant_method we cannot run (gptq, awq, fp8...)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    context_length: int = 0
    vision: bool = False
    audio: bool = False
    torch_dtype: str | None = None  # the dtype the checkpoint declares, if any
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else self.model_type


def _spellings(module_path: str) -> list[str]:
    """A module's path, then the paths mlx-lm writes for it in a multimodal wrapper
    (``language_model.model.layers.0...`` for the engine's ``model.layers.0...``), where
    a converted wrapper's per-layer overrides are keyed."""
    if module_path.startswith("model."):
        rest = module_path[len("model.") :]
        return [module_path, f"language_model.model.{rest}", f"model.language_model.{rest}"]
    return [module_path, f"language_model.{module_path}"]


def read_json(path: Path) -> Any:
    """Parse a JSON file; a syntax error names the file and the line."""
    try:
        text = read_text_bounded(path, SETTINGS_LIMIT, "a model's settings", ModelLoadError)
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path} is not UTF-8 text ({e.reason}): download it again") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ModelLoadError(
            f"{path.name} is nested too deeply to be a model's settings; fix or re-download {path}"
        ) from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{path.name} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix or re-download {path}"
        ) from None


def read_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present) from a model folder."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder; point at a model folder holding config.json")
    if not config_file.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; a model folder needs config.json, *.safetensors and tokenizer files"
        )
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object, not {type(raw).__name__}")
    generation: dict[str, Any] = {}
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = read_json(generation_file)  # checked, whatever it holds, in config_from_dict
    return config_from_dict(raw, generation, path=folder)


def config_from_dict(
    raw: dict[str, Any], generation: dict[str, Any] | None = None, *, path: Path | None = None
) -> ModelConfig:
    """Normalise a config dict (as config.json holds it) into a ModelConfig."""
    raw = copy.deepcopy(raw)
    generation = generation or {}
    where = f"{path / 'config.json'}" if path is not None else "the model's config"
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{where} has no model_type, so the model family is unknown; re-download the model")

    normalise_rope(raw)
    check_model_settings(raw, where)
    text = text_config_or_none(raw)
    if text is not None:
        normalise_rope(text)
        check_model_settings(text, f"{where} (text_config)")
    else:
        text = raw
    if generation:
        check_generation_settings(
            generation, "generation_config.json" if path is None else f"{path / 'generation_config.json'}"
        )

    quant, foreign = _quantization(raw, where)
    eos = _ids(raw.get("eos_token_id")) + _ids(text.get("eos_token_id")) + _ids(generation.get("eos_token_id"))
    bos = _first_id(raw.get("bos_token_id"), text.get("bos_token_id"), generation.get("bos_token_id"))

    return ModelConfig(
        model_type=model_type,
        raw=raw,
        text=text,
        quantization=quant,
        foreign_quantization=foreign,
        eos_token_ids=list(dict.fromkeys(eos)),
        bos_token_id=bos,
        generation_defaults=_generation_defaults(generation),
        context_length=_context_length(text, raw),
        # Gemma 4 writes "audio_config": null on the models without an audio tower.
        vision=raw.get("vision_config") is not None,
        audio=raw.get("audio_config") is not None,
        torch_dtype=_declared_dtype(raw, text),
        path=path,
    )


def _whole_setting(block: dict[str, Any], key: str, where: str) -> int:
    value = block[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ModelLoadError(
            f"{where} says quantization.{key} is {value!r}; it must be a whole number such as 4 or 64: "
            "the file is damaged or mistyped"
        )
    return int(value)


def _quantization(raw: dict[str, Any], where: str) -> tuple[QuantizationSpec | None, str | None]:
    block = raw.get("quantization")
    if block is None:
        block = raw.get("quantization_config")
    if not isinstance(block, dict):
        return None, None
    method = block.get("quant_method")
    if method == "mxfp4" and "bits" not in block:
        # gpt-oss's own checkpoints: experts in MXFP4 blocks, which MLX runs as mode mxfp4
        # once the family's sanitize has laid them out (mlx-lm reads this block the same way).
        return QuantizationSpec(bits=4, group_size=32, mode="mxfp4"), None
    if method is not None and method != "mlx":
        return None, str(method)
    if "bits" not in block or "group_size" not in block:
        return None, "unknown"
    overrides = {k: v for k, v in block.items() if isinstance(v, (dict, bool))}
    return (
        QuantizationSpec(
            bits=_whole_setting(block, "bits", where),
            group_size=_whole_setting(block, "group_size", where),
            mode=str(block.get("mode", "affine")),
            overrides=overrides,
        ),
        None,
    )


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _first_id(*values: Any) -> int | None:
    for value in values:
        ids = _ids(value)
        if ids:
            return ids[0]
    return None


def _generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    defaults = {k: generation[k] for k in _GENERATION_KEYS if generation.get(k) is not None}
    # transformers ignores temperature & co. when do_sample is false: that means greedy.
    if generation.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def _context_length(text: dict[str, Any], raw: dict[str, Any]) -> int:
    for cfg in (text, raw):
        for key in _CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def _declared_dtype(raw: dict[str, Any], text: dict[str, Any]) -> str | None:
    for cfg in (text, raw):
        for key in ("torch_dtype", "dtype"):
            if isinstance(cfg.get(key), str):
                return cfg[key]
    return None
