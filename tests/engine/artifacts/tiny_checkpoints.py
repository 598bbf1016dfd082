"""Tiny checkpoints written the way mlx-community and Hugging Face publish them.

Weights are random, drawn through our own llama family and written with
mx.save_safetensors, so a test can load a folder back and compare its logits with the
in-memory model that wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import models

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Wide enough that every input dimension divides by 128, for group-size-128 tests.
WIDE_LLAMA = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256}

PROMPT = mx.array([[1, 17, 42, 99, 3, 250, 7]])


@dataclass
class Checkpoint:
    path: Path
    model: Any  # the in-memory model whose parameters were written
    config: dict[str, Any]

    def logits(self, inputs: mx.array = PROMPT) -> mx.array:
        return self.model(inputs)


def build_model(config: dict[str, Any], seed: int = 0) -> Any:
    family = models.get_family(config["model_type"])
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    # Spread the weights so logits differ clearly between tokens.
    model.update(_tree_scaled(model.parameters()))
    return model


def _tree_scaled(params: dict) -> dict:
    from mlx.utils import tree_map

    return tree_map(lambda a: mx.random.normal(a.shape, dtype=a.dtype) * 0.2 if a.ndim > 1 else a, params)


def write_checkpoint(
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    dtype: mx.Dtype = mx.bfloat16,
    bits: int | None = None,
    group_size: int = 64,
    overrides: dict[str, Any] | None = None,
    shards: int = 1,
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Checkpoint:
    """A model folder: config.json, model(-0000N-of-0000M).safetensors, index when sharded."""
    config = dict(config or TINY_LLAMA)
    model = build_model(config, seed)
    model.set_dtype(dtype)
    if bits is not None:
        overrides = overrides or {}

        def predicate(path: str, module: Any) -> bool | dict:
            if not hasattr(module, "to_quantized"):
                return False
            override = overrides.get(path, True)
            if override is False:
                return False
            params = {"bits": bits, "group_size": group_size}
            if isinstance(override, dict):
                params.update(override)
            return params

        nn.quantize(model, class_predicate=predicate)
        block = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
        config["quantization"] = block
        config["quantization_config"] = block
    config.update(extra_config or {})
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(tree_flatten(model.parameters()))
    mx.eval(list(params.values()))
    names = sorted(params)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), params, metadata={"format": "mlx"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(folder / filename), {n: params[n] for n in part}, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(part, filename))
        index = {"metadata": {"total_size": sum(v.nbytes for v in params.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return Checkpoint(folder, model, config)
