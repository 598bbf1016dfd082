"""Qwen2-Audio: a Qwen2 language model that hears through a Whisper-style audio tower.

This module is the language-model side (``text_config`` -> Qwen2); the checkpoint's
``language_model.*`` weights load with the model, the ``audio_tower.*`` and
``multi_modal_projector.*`` ones are left for ``engine.media.qwen2_audio.tower``, which
loads them on the first audio request. ``audio_token_index`` is the <|AUDIO|>
placeholder whose embeddings the projected audio replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.artifacts.config_spellings import text_config_or_none
from engine.models import qwen2
from engine.models.base import NESTED_LM_PREFIXES, strip_prefixes

# Hub checkpoints nest the LM under language_model.; transformers 5 saves model.language_model.
_TOWERS = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")


@dataclass
class ModelArgs(qwen2.ModelArgs):
    audio_token_index: int = 151646
    audio_config: dict[str, Any] | None = None

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        inner = text_config_or_none(config) or {}
        merged = super().normalise(config)
        # Qwen2Config does not tie embeddings unless its own settings say so.
        merged["tie_word_embeddings"] = bool(inner.get("tie_word_embeddings", False))
        merged["audio_token_index"] = config.get("audio_token_index", config.get("audio_token_id", 151646))
        merged["audio_config"] = config.get("audio_config") or {}
        merged["model_type"] = "qwen2"
        return merged


class Model(qwen2.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(strip_prefixes(weights, NESTED_LM_PREFIXES, _TOWERS))
