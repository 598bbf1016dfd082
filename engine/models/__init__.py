"""Model families, looked up by config.json's ``model_type``.

Each family module exposes ``ModelArgs`` (``ModelArgs.from_dict(config)``) and
``Model`` (``Model(args)``; ``model(inputs, cache=None, input_embeddings=None)`` ->
logits; ``sanitize(weights)``; ``make_cache()``; ``layers``; ``embed_tokens``; ``args``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

# model_type -> module in this package
SUPPORTED: dict[str, str] = {
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "llama": "llama",
    "mistral": "llama",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_audio": "qwen2_audio",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "voxtral": "voxtral",
}


def get_family(model_type: str) -> ModuleType:
    """The module implementing ``model_type``; UnsupportedModelError names the known ones."""
    name = SUPPORTED.get(str(model_type))
    if name is None:
        known = ", ".join(sorted(SUPPORTED))
        raise UnsupportedModelError(f"Unsupported architecture '{model_type}'. MLX Desk runs: {known}.")
    return importlib.import_module(f"{__name__}.{name}")
