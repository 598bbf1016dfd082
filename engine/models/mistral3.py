"""Mistral 3 (Mistral Small 3.1 / 3.2): a Mistral language model that sees through a
Pixtral vision tower.

This module is the language-model side (``text_config``, a ``mistral`` or ``llama``
model); the ``vision_tower.*`` and ``multi_modal_projector.*`` weights are left for
engine/media/pixtral, which loads them on the first image. Weights:
``model.language_model.*`` (transformers 5) or ``language_model.model.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..errors import UnsupportedModelError
from . import llama
from .base import NESTED_LM_PREFIXES, strip_prefixes

_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_TYPES = ("mistral", "llama")


@dataclass
class ModelArgs(llama.ModelArgs):
    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        text_type = inner.get("model_type", "mistral")
        if text_type not in TEXT_TYPES:
            raise UnsupportedModelError(
                f"This Mistral 3 checkpoint's language model is '{text_type}'; MLX Desk runs Mistral 3 with a "
                f"{' or '.join(TEXT_TYPES)} language model."
            )
        merged = super().normalise({**config, "text_config": {"model_type": "mistral", **inner}})
        # transformers 5 ties by the wrapper's setting (its Mistral3Config writes one); a
        # published config without it follows its text_config.
        tie = config.get("tie_word_embeddings", inner.get("tie_word_embeddings", False))
        merged["tie_word_embeddings"] = bool(tie)
        return merged


class Model(llama.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(strip_prefixes(weights, NESTED_LM_PREFIXES, _TOWERS))
