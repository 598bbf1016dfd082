"""Model families, looked up by config.json's ``model_type``.

Each family module exposes ``ModelArgs`` (``ModelArgs.from_dict(config)``) and
``Model`` (``Model(args)``; ``model(inputs, cache=None, input_embeddings=None)`` ->
logits; ``sanitize(weights)``; ``make_cache()``; ``layers``; ``embed_tokens``; ``args``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import UnsupportedModelError

# model_type -> module in this package
SUPPORTED: dict[str, str] = {
    "deepseek_v3": "deepseek_v3",
    "diffusion_gemma": "diffusion_gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "gpt_oss": "gpt_oss",
    "glm4_moe": "glm4_moe",
    "glm4_moe_lite": "glm4_moe_lite",
    "glm_moe_dsa": "glm_moe_dsa",
    "kimi_k2": "deepseek_v3",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "llama": "llama",
    "ministral3": "ministral3",
    "mistral": "llama",
    "mistral3": "mistral3",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_audio": "qwen2_audio",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "smollm3": "smollm3",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
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
