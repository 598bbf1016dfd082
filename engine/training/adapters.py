"""Trainable LoRA and DoRA layers, put on a model's linear layers, and saved as mlx-lm saves them.

``add_adapters`` wraps the chosen linear layers (``keys``: module names inside each of the
last ``layers`` blocks, matched by their last parts, e.g. ``q_proj`` or
``self_attn.q_proj``) of a frozen model in ``LoRALinear`` / ``DoRALinear``, whose only
trainable arrays are ``lora_a`` [in, r], ``lora_b`` [r, out] (and DoRA's magnitude
``m`` [out]). The forward pass is mlx-lm's: ``y = W x + scale * (x @ a) @ b``; DoRA
rescales ``W + scale * (a @ b)^T`` row by row to ``m``. A quantized base (QLoRA) stays
quantized; only the adapter is in float32.

``init_from`` starts the adapter from a saved one (mlx-lm's ``adapters.safetensors`` or
PEFT's ``adapter_model.safetensors``, whose ``lora_A`` [r, in] / ``lora_B`` [out, r] are
the transposes, with scale ``lora_alpha / r``). ``save_adapter`` writes mlx-lm's folder:
``adapters.safetensors`` (``<module path>.lora_a`` ...) and ``adapter_config.json``
(``fine_tune_type``, ``num_layers``, ``lora_parameters`` with ``rank``, ``scale``,
``dropout``, ``keys``), which mlx-lm's ``load_adapters`` and this engine's mounting read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import EngineError

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj")


class TrainingError(EngineError):
    """Training cannot run as asked."""


def _dims(linear: nn.Module) -> tuple[int, int]:
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


def _dense_weight(linear: nn.Module) -> mx.array:
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight, linear.scales, linear.biases, group_size=linear.group_size, bits=linear.bits,
            mode=getattr(linear, "mode", "affine"),
        )  # fmt: skip
    return linear.weight


class LoRALinear(nn.Module):
    def __init__(self, linear: nn.Module, rank: int, scale: float):
        super().__init__()
        in_dims, out_dims = _dims(linear)
        self.linear = linear
        self.scale = scale
        bound = 1 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, rank))
        self.lora_b = mx.zeros((rank, out_dims))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (x @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)


class DoRALinear(LoRALinear):
    def __init__(self, linear: nn.Module, rank: int, scale: float):
        super().__init__(linear, rank, scale)
        self.m = mx.linalg.norm(_dense_weight(linear).astype(mx.float32), axis=1)

    def __call__(self, x: mx.array) -> mx.array:
        weight = _dense_weight(self.linear)
        y = x @ weight.T
        z = (x @ self.lora_a) @ self.lora_b
        out = y + (self.scale * z).astype(x.dtype)
        adapted = weight + (self.scale * self.lora_b.T) @ self.lora_a.T
        norm = mx.stop_gradient(mx.linalg.norm(adapted, axis=1))  # as DoRA's paper and mlx-lm
        out = (self.m / norm).astype(x.dtype) * out
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out


@dataclass
class AdapterSpec:
    rank: int = 8
    scale: float = 20.0
    layers: int = 16
    keys: list[str] = field(default_factory=lambda: list(DEFAULT_KEYS))
    dora: bool = False


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not layers:
        raise TrainingError("This model has no list of transformer blocks to put adapters on; it cannot be trained.")
    return list(layers)


def _matches(path: str, key: str) -> bool:
    return path == key or path.endswith("." + key)


class AdapterLayers(dict):
    """{module path: adapter layer}, and where each layer sits: ``homes[path]`` is (block
    index, path inside the block), which is the path itself or, on a layer that already
    carries mounted adapters (engine.models.lora.LoRAHost), its ``base`` inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.homes: dict[str, tuple[int, str]] = {}


def _is_mount_host(module: nn.Module) -> bool:
    return hasattr(module, "adapter_names") and isinstance(
        getattr(module, "base", None), nn.Linear | nn.QuantizedLinear
    )


def add_adapters(model: nn.Module, spec: AdapterSpec) -> AdapterLayers:
    """Freeze ``model`` and wrap the chosen linear layers; returns {module path: adapter layer}.
    A layer with mounted adapters is trained underneath them: they should be off meanwhile."""
    if spec.rank < 1:
        raise TrainingError(f"--rank must be at least 1 (got {spec.rank})")
    blocks = _blocks(model)
    chosen = blocks[-max(spec.layers, 0) :] if spec.layers > 0 else []
    if not chosen:
        raise TrainingError(f"--layers must be at least 1 (got {spec.layers})")
    model.freeze()
    wrap = DoRALinear if spec.dora else LoRALinear
    first = len(blocks) - len(chosen)
    found = AdapterLayers()
    full_keys: set[str] = set()
    prefix = _block_prefix(model)
    for index, block in enumerate(chosen, first):
        swaps = []
        for path, module in block.named_modules():
            if not any(_matches(path, k) for k in spec.keys):
                continue
            if isinstance(module, nn.Linear | nn.QuantizedLinear):
                swaps.append((path, path, module))
            elif _is_mount_host(module):
                swaps.append((path, f"{path}.base", module.base))
        for path, home, linear in swaps:
            layer = wrap(linear, spec.rank, spec.scale)
            replace_module(block, home, layer)
            found[f"{prefix}.{index}.{path}"] = layer
            found.homes[f"{prefix}.{index}.{path}"] = (index, home)
            full_keys.add(path)
    if not found:
        raise TrainingError(
            f"No linear layer matches --keys {','.join(spec.keys)} in the last {len(chosen)} blocks; "
            "name modules as the model does (e.g. q_proj,v_proj,o_proj,gate_proj)."
        )
    spec.keys = sorted(full_keys)  # as mlx-lm's config names them: paths inside a block
    return found


def _block_prefix(model: nn.Module) -> str:
    """Where the blocks sit in the parameter tree (``model.layers`` for most families)."""
    first = _blocks(model)[0]
    for name, module in model.named_modules():
        if module is first:
            return name.rsplit(".", 1)[0]
    return "model.layers"


def replace_module(block: nn.Module, path: str, layer: nn.Module) -> None:
    parts = path.split(".")
    parent: Any = block
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    setattr(parent, parts[-1], layer)


def adapter_weights(found: dict[str, nn.Module]) -> dict[str, mx.array]:
    out = {}
    for path, layer in found.items():
        out[f"{path}.lora_a"] = layer.lora_a
        out[f"{path}.lora_b"] = layer.lora_b
        if isinstance(layer, DoRALinear):
            out[f"{path}.m"] = layer.m
    return out


def init_from(folder: str | Path, found: dict[str, nn.Module], spec: AdapterSpec) -> None:
    """Start from a saved mlx-lm or PEFT adapter: same targets and rank; its scale wins."""
    folder = Path(folder)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise TrainingError(f"--adapter-init {folder} has no adapter_config.json (an mlx-lm or PEFT adapter folder)")
    config = json.loads(config_path.read_text())
    weights: dict[str, mx.array] = {}
    if (folder / "adapters.safetensors").is_file():
        scale = float((config.get("lora_parameters") or {}).get("scale", spec.scale))
        for key, value in mx.load(str(folder / "adapters.safetensors")).items():
            weights[key] = value
    elif (folder / "adapter_model.safetensors").is_file():
        r = int(config.get("r", spec.rank))
        scale = float(config.get("lora_alpha", r)) / (math.sqrt(r) if config.get("use_rslora") else r)
        for key, value in mx.load(str(folder / "adapter_model.safetensors")).items():
            path = key.removeprefix("base_model.model.")
            for theirs, ours in (("lora_A.weight", "lora_a"), ("lora_B.weight", "lora_b")):
                if path.endswith("." + theirs):
                    weights[path[: -len(theirs)] + ours] = value.T
            if path.endswith(".lora_magnitude_vector") or path.endswith(".lora_magnitude_vector.weight"):
                weights[path.split(".lora_magnitude_vector")[0] + ".m"] = value.reshape(-1)
    else:
        raise TrainingError(f"--adapter-init {folder} has no adapters.safetensors or adapter_model.safetensors")
    mine = adapter_weights(found)
    missing = sorted(set(mine) - set(weights))
    extra = sorted(set(weights) - set(mine))
    if missing or extra:
        what = f"it lacks {missing[0]}" if missing else f"it has {extra[0]}, which this training does not"
        raise TrainingError(
            f"--adapter-init {folder} does not target the same layers ({what}); match --layers and --keys to it."
        )
    for key, value in weights.items():
        if value.shape != mine[key].shape:
            raise TrainingError(
                f"--adapter-init {folder}: {key} is {tuple(value.shape)}, not {tuple(mine[key].shape)}; match --rank."
            )
    for path, layer in found.items():
        layer.lora_a = weights[f"{path}.lora_a"].astype(mx.float32)
        layer.lora_b = weights[f"{path}.lora_b"].astype(mx.float32)
        if isinstance(layer, DoRALinear):
            layer.m = weights[f"{path}.m"].astype(mx.float32)
        layer.scale = scale
    spec.scale = scale


def save_adapter(folder: str | Path, found: dict[str, nn.Module], spec: AdapterSpec, base_model: str) -> Path:
    """mlx-lm's adapter folder (written to temporary names, then renamed into place)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "fine_tune_type": "dora" if spec.dora else "lora",
        "num_layers": spec.layers,
        "lora_parameters": {"rank": spec.rank, "scale": spec.scale, "dropout": 0.0, "keys": list(spec.keys)},
        "model": base_model,
    }
    weights = folder / "adapters.safetensors"
    partial = folder / ".adapters.partial.safetensors"
    mx.save_safetensors(str(partial), adapter_weights(found), {"format": "mlx"})
    partial.replace(weights)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
