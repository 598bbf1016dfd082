"""Model families, looked up by config.json's ``model_type`` in the family manifest
(``engine.models.families``).

Each family module exposes ``ModelArgs`` (``ModelArgs.from_dict(config)``) and
``Model`` (``Model(args)``; ``model(inputs, cache=None, input_embeddings=None)`` ->
logits; ``sanitize(weights)``; ``make_cache()``; ``layers``; ``embed_tokens``; ``args``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import UnsupportedModelError
from engine.models.families import FAMILIES

# model_type -> module in this package (the family manifest's ``module``)
SUPPORTED: dict[str, str] = {model_type: family.module for model_type, family in FAMILIES.items()}


def get_family(model_type: str) -> ModuleType:
    """The module implementing ``model_type``; UnsupportedModelError names the known ones."""
    name = SUPPORTED.get(str(model_type))
    if name is None:
        known = ", ".join(sorted(SUPPORTED))
        raise UnsupportedModelError(f"Unsupported architecture '{model_type}'. MLX Desk runs: {known}.")
    return importlib.import_module(f"{__name__}.{name}")
