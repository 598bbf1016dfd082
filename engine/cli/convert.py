"""Hugging Face folder -> MLX folder, optionally quantized (the CLI's ``convert``).

The output is what mlx-community publishes: config.json with a ``quantization`` block
(and the same under ``quantization_config``), sharded safetensors with an index, and
the tokenizer files copied across. ``engine.runtime.loading`` reads it back.

The folder appears whole or not at all: it is written under a hidden name beside the
target and renamed when every shard has been written and read back; a full disk, a write
error or Ctrl-C removes the hidden folder and says so in one line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.artifacts.config import QuantizationSpec, read_config, read_json
from engine.artifacts.sanity import check_model_files
from engine.artifacts.weights import INDEX_NAME, find_weights, load_weights, read_header, read_headers
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
    if out.exists() and not out.is_dir():
        raise ModelLoadError(f"{out} is a file; give the name of a new output folder")
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"{out} already exists and is not empty; choose a new output folder")
    if src.resolve() == out.resolve():
        raise ModelLoadError("the output folder must differ from the input folder")

    config = read_config(src)
    headers = read_headers(find_weights(src))
    check_model_files(
        config,
        {n: t.shape for n, t in headers.items()},
        packed=frozenset(n for n, t in headers.items() if t.dtype[:1] in "UI"),
    )
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

    params = dict(tree_flatten(model.parameters()))
    raw_config = read_json(src / "config.json")
    for key in ("quantization", "quantization_config"):
        raw_config.pop(key, None)
    if spec is not None:
        raw_config["quantization"] = spec.to_dict()
        raw_config["quantization_config"] = spec.to_dict()
    if dtype is not None:
        raw_config["torch_dtype"] = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)

    def write(folder: Path) -> None:
        _save_shards(folder, params, shard_bytes)
        (folder / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)

    _write_whole(out, write)
    mx.clear_cache()
    return out


def _write_whole(out: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` into a hidden folder beside ``out``, then rename it to ``out``: a full
    disk, a write error or Ctrl-C leaves no half-written model that would later load as
    damaged, and the hidden folder is removed on the way out."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write(staging)
        if out.is_dir():
            out.rmdir()  # an empty folder the user made for the result (checked empty before)
        staging.rename(out)
    except OSError as e:
        raise ModelLoadError(
            f"cannot write {out}: {e.strerror or e} (nothing was left behind; free some space or pick another folder)"
        ) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _check_written(file: Path, shard: dict[str, Any]) -> None:
    """A shard is as long as its header says and holds every tensor: a write that stopped
    short (a full disk the writer did not report) is caught here, not at the next load."""
    try:
        held = read_header(file)
    except ModelLoadError as e:
        raise OSError(f"{file.name} came out incomplete ({e})") from None
    if set(held) != set(shard):
        raise OSError(f"{file.name} came out incomplete")


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
        try:
            mx.save_safetensors(str(out / filename), shard, metadata={"format": "mlx"})
        except RuntimeError as e:  # MLX words a failed write as a RuntimeError
            raise OSError(str(e).splitlines()[0] if str(e) else "the write failed") from None
        _check_written(out / filename, shard)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(v.nbytes for v in params.values())}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
