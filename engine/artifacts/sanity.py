"""Configs that cannot describe a real model are refused before anything is allocated.

A config.json is checked against itself (sizes are positive whole numbers small enough
for the arrays they shape) and against the weight files' headers (the layers it names
exist, the embedding width agrees with ``hidden_size``). Each refusal is one line that
names both sides, so nobody waits for 24 GB of a million layers to be built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import ModelLoadError

# Sizes that shape arrays: each must be a whole number in [minimum, MAX_DIM].
_SIZES = {
    "hidden_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 1,
    "vocab_size": 1,
    "head_dim": 1,
}
MAX_DIM = 2**31 - 1  # MLX indexes arrays with 32-bit integers
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk|h|layer|blocks)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)embed_tokens\.weight$")


def check_config_sizes(text: Mapping[str, Any], where: str) -> None:
    """Refuse sizes that are missing their meaning: zero, negative, fractional, absurd."""
    for key, minimum in _SIZES.items():
        if key not in text or text[key] is None:
            continue
        value = text[key]
        if isinstance(value, list):  # per-layer sizes (a few families): check each
            values = value
        else:
            values = [value]
        for v in values:
            whole = isinstance(v, int) and not isinstance(v, bool)
            if isinstance(v, float) and v.is_integer():
                whole, v = True, int(v)
            if not whole or not minimum <= v <= MAX_DIM:
                raise ModelLoadError(
                    f"{where} says {key} is {value!r}; it must be a whole number from {minimum} to "
                    f"{MAX_DIM:,}: the file is damaged or not a model's config"
                )


def check_against_headers(
    text: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    where: str,
    *,
    quantized: bool = False,
    packed: frozenset[str] = frozenset(),
) -> None:
    """Refuse a config whose layer count or width the weight files do not hold. ``packed``
    names tensors stored as packed integers (quantized), whose widths say nothing."""
    layers = text.get("num_hidden_layers")
    indices = {int(m.group(1)) for name in shapes for m in [_LAYER_INDEX.search(name)] if m}
    if isinstance(layers, int) and indices and layers > max(indices) + 1:
        raise ModelLoadError(
            f"{where} says num_hidden_layers is {layers:,} but the weight files hold "
            f"{max(indices) + 1:,} layers: the config and the weights are from different models"
        )
    hidden = text.get("hidden_size")
    if quantized or not isinstance(hidden, int):
        return  # packed quantized embeddings are narrower than hidden_size by design
    for name, shape in shapes.items():
        if _EMBEDDING.search(name) and len(shape) == 2 and shape[-1] != hidden and name not in packed:
            raise ModelLoadError(
                f"{where} says hidden_size is {hidden:,} but {name} in the weight files is "
                f"{shape[0]:,}×{shape[1]:,}: the config and the weights are from different models"
            )


def check_model_files(
    config: Any, shapes: Mapping[str, Sequence[int]], *, gguf: bool = False, packed: frozenset[str] = frozenset()
) -> None:
    """Both checks for a ModelConfig and its weight headers (name -> shape)."""
    where = (
        config.path.name
        if gguf and config.path is not None
        else (str(config.path / "config.json") if config.path is not None else "the model's config")
    )
    check_config_sizes(config.text, where)
    check_against_headers(config.text, shapes, where, quantized=gguf or config.quantization is not None, packed=packed)
    if not gguf and config.quantization is None and config.foreign_quantization is None:
        # Packed weights beside their .scales are MLX-quantized without a config block:
        # the checkpoint loader names that case itself.
        plain = frozenset(n for n in packed if f"{n.rpartition('.')[0]}.scales" not in shapes)
        check_float_weights(plain, config.name)


def check_float_weights(integer_tensors: frozenset[str], model: str) -> None:
    """An unquantized checkpoint computes in floating point: a weight or bias stored as
    integers (an int32 export, a half-finished conversion) cannot be multiplied as it is
    and would fail deep inside MLX. ``integer_tensors`` names the integer-typed tensors."""
    bad = sorted(n for n in integer_tensors if n.rpartition(".")[2] in ("weight", "bias"))
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ModelLoadError(
            f"{model} stores {bad[0]}{more} as integers, but its config.json declares no quantization: "
            "the weights must be float16, bfloat16 or float32 (re-export or re-download them)"
        )
