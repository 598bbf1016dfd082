"""Mistral 3 (Mistral Small 3.1 / 3.2): a Mistral language model that sees through a
Pixtral vision tower.

This module is the language-model side (``text_config``: ``mistral``, ``llama`` or ``ministral3``
model); the ``vision_tower.*`` and ``multi_modal_projector.*`` weights are left for
engine/media/pixtral, which loads them on the first image. Weights:
``model.language_model.*`` (transformers 5) or ``language_model.model.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.artifacts.config_spellings import text_config_or_none
from engine.errors import UnsupportedModelError
from engine.models import ministral3

TEXT_TYPES = ("mistral", "llama", "ministral3")


@dataclass
class ModelArgs(ministral3.ModelArgs):
    """The language model of a Mistral 3 checkpoint: Ministral 3's (YaRN, position-scaled
    queries) when its text_config says so, else a plain Mistral/Llama stack, which is
    Ministral 3's with those switched off."""

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        inner = text_config_or_none(config) or {}
        text_type = inner.get("model_type", "mistral")
        if text_type not in TEXT_TYPES:
            raise UnsupportedModelError(
                f"This Mistral 3 checkpoint's language model is '{text_type}'; MLX Desk runs Mistral 3 with a "
                f"{', '.join(TEXT_TYPES)} language model."
            )
        return super().normalise({**config, "text_config": {"model_type": "mistral", **inner}})


class Model(ministral3.Model):
    pass
