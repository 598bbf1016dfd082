"""Hugging Face folder -> MLX folder, optionally quantized (the CLI's ``convert``).

The output is what mlx-community publishes: config.json with a ``quantization`` block
(and the same under ``quantization_config``), sharded safetensors with an index, and
the tokenizer files copied across. ``engine.runtime.loading`` reads it back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from engine.artifacts.config import QuantizationSpec, read_config, read_json
from engine.artifacts.weights import INDEX_NAME, find_weights, load_weights
from engine.errors import ModelLoadError
from engine.models.checkpoint import cast_floats, fill_weights, quantize_like_checkpoint

# Files a model folder needs besides weights and config.json.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tekken.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

DEFAULT_SHARD_BYTES = 5 * 1024**3
_BITS = (2, 3, 4, 5, 6, 8)
_GROUPS = (32, 64, 128)


def convert(
    hf_path: str | Path,
    out_path: str | Path,
    *,
    quantize_bits: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    overrides: dict[str, dict[str, int] | bool] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write an MLX model folder at ``out_path``; returns it.

    ``quantize_bits`` quantizes every Linear/Embedding whose input width divides by the
    group size (affine). ``overrides`` maps module paths to their own
    ``{"bits", "group_size"}`` or to False to leave a module unquantized.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from engine import models

    src, out = Path(hf_path), Path(out_path)
    if quantize_bits is not None and quantize_bits not in _BITS:
        raise ModelLoadError(f"cannot quantize to {quantize_bits} bits; choose one of {', '.join(map(str, _BITS))}")
    if group_size not in _GROUPS:
        raise ModelLoadError(f"group size {group_size} is not supported; choose 32, 64 or 128")
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"{out} already exists and is not empty; choose a new output folder")
    if src.resolve() == out.resolve():
        raise ModelLoadError("the output folder must differ from the input folder")

    config = read_config(src)
    family = models.get_family(config.model_type)
    model = family.Model(family.ModelArgs.from_dict(config.raw))
    weights = model.sanitize(load_weights(find_weights(src)))
    if quantize_bits is not None and config.quantization is not None:
        raise ModelLoadError(
            f"{src.name} is already quantized ({config.quantization.describe()}); convert the original"
        )
    quantize_like_checkpoint(model, set(weights), config.quantization, name=src.name)
    if dtype is not None:
        weights = cast_floats(weights, dtype)
    fill_weights(model, weights, name=src.name)
    del weights

    spec = config.quantization
    if quantize_bits is not None:
        spec = QuantizationSpec(bits=quantize_bits, group_size=group_size, overrides=dict(overrides or {}))

        def predicate(path: str, module: Any) -> bool | dict[str, Any]:
            if not hasattr(module, "to_quantized") or not hasattr(module, "weight"):
                return False
            params = spec.params_for(path)
            if params is None or module.weight.shape[-1] % params["group_size"]:
                return False
            return params

        nn.quantize(model, class_predicate=predicate)

    out.mkdir(parents=True, exist_ok=True)
    params = dict(tree_flatten(model.parameters()))
    _save_shards(out, params, shard_bytes)

    raw_config = read_json(src / "config.json")
    for key in ("quantization", "quantization_config"):
        raw_config.pop(key, None)
    if spec is not None:
        raw_config["quantization"] = spec.to_dict()
        raw_config["quantization_config"] = spec.to_dict()
    if dtype is not None:
        raw_config["torch_dtype"] = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    mx.clear_cache()
    return out


def _save_shards(out: Path, params: dict[str, Any], shard_bytes: int) -> None:
    import mlx.core as mx

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(params):
        value = params[name]
        if shards[-1] and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes

    total = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
        mx.eval(list(shard.values()))
        mx.save_safetensors(str(out / filename), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(v.nbytes for v in params.values())}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
