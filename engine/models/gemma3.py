"""Gemma 3 text: Gemma 2's block with RMSNorm on queries and keys and a local/global pattern.

Local (sliding-window) layers use their own RoPE base (``rope_local_base_freq``, no
scaling); global layers use ``rope_theta`` with ``rope_scaling``. Handles both
``gemma3_text`` configs and the multimodal ``gemma3`` wrapper (settings under
``text_config``, weights under ``language_model.`` or ``model.language_model.``); the
vision tower's weights are left to the media code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import gemma2
from .base import RoPE, layer_types, make_rope, rope_settings, text_config


@dataclass
class ModelArgs(gemma2.ModelArgs):
    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10000.0
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = text_config(config)
        config["rope_theta"], config["rope_scaling"] = rope_settings(config, "full_attention", 1_000_000.0)
        params = config.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
            base, scaling = rope_settings(config, "sliding_attention", 10000.0)
        else:  # older spelling: rope_scaling belongs to the global layers only
            base, scaling = float(config.get("rope_local_base_freq") or 10000.0), None
        config["rope_local_base_freq"], config["local_rope_scaling"] = base, scaling
        config["partial_rotary_factor"] = 1.0
        return config

    def default_layer_types(self) -> list[str]:
        p = self.sliding_window_pattern
        return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(self.num_hidden_layers)]

    def kinds(self) -> list[str]:
        return layer_types({"layer_types": self.layer_types}, self.num_hidden_layers, self.default_layer_types())

    def rope_for(self, kind: str) -> RoPE:
        if kind == "sliding_attention":
            return make_rope(self.head_dim, self.rope_local_base_freq, self.local_rope_scaling,
                             self.max_position_embeddings)
        return make_rope(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)


class DecoderLayer(gemma2.DecoderLayer):
    qk_norm = True


class GemmaModel(gemma2.GemmaModel):
    layer_class = DecoderLayer


# Multimodal checkpoints nest the language model under one of these prefixes.
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("language_model.", ""))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "audio_tower.", "model.audio_tower.")


class Model(gemma2.Model):
    model_class = GemmaModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        renamed: dict[str, mx.array] = {}
        for key, value in weights.items():
            if key.startswith(_OTHER_TOWERS):
                continue
            for old, new in _PREFIXES:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            renamed[key] = value
        return super().sanitize(renamed)
