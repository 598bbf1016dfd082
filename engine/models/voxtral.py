"""Voxtral: a Llama-style language model (Ministral / Mistral Small) that hears through a
Whisper-style encoder.

This module is the language-model side (``text_config`` -> Llama); the checkpoint's
``language_model.*`` weights load with the model, the ``audio_tower.*`` and
``multi_modal_projector.*`` ones are left for ``engine.media.voxtral.tower``, which loads
them on the first audio request. ``audio_token_id`` is the [AUDIO] placeholder whose
embeddings the projected audio replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.artifacts.config_spellings import text_config_or_none
from engine.models import llama
from engine.models.base import NESTED_LM_PREFIXES, strip_prefixes

_TOWERS = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")

# VoxtralConfig fills a partial text_config with Voxtral-Mini-3B's settings before
# LlamaConfig's own defaults apply; a config that leaves them out means these.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 30,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000000.0,
    "head_dim": 128,
}
AUDIO_TOKEN_ID = 24  # [AUDIO] in Mistral's tekken vocabulary; VoxtralProcessor assumes it too


@dataclass
class ModelArgs(llama.ModelArgs):
    audio_token_id: int = AUDIO_TOKEN_ID
    audio_config: dict[str, Any] | None = None

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        inner = text_config_or_none(config) or {}
        # A text_config in transformers 5's spelling carries its base in rope_parameters.
        defaults = dict(TEXT_DEFAULTS)
        if "rope_parameters" in inner:
            defaults.pop("rope_theta")
        merged = super().normalise({**config, "text_config": {**defaults, **inner}})
        merged["tie_word_embeddings"] = bool(inner.get("tie_word_embeddings", False))
        audio_id = config.get("audio_token_id")
        merged["audio_token_id"] = int(audio_id) if audio_id is not None else AUDIO_TOKEN_ID
        merged["audio_config"] = config.get("audio_config") or {}
        merged["model_type"] = "llama"
        return merged


class Model(llama.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(strip_prefixes(weights, NESTED_LM_PREFIXES, _TOWERS))
