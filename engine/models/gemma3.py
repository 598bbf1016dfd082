"""Gemma 3 text: Gemma 2's block with RMSNorm on queries and keys and a local/global pattern.

Local (sliding-window) layers use their own RoPE base (``rope_local_base_freq``, no
scaling); global layers use ``rope_theta`` with ``rope_scaling``. Handles both
``gemma3_text`` configs and the multimodal ``gemma3`` wrapper (settings under
``text_config``, weights under ``language_model.`` or ``model.language_model.``); the
vision tower's weights are left to the media code (engine/media/gemma3/vision.py).

With images, transformers lets the soft tokens of one image attend to each other in
both directions during prefill (its token_type_ids overlay): full layers use
causal OR same-image, sliding layers AND that with the window. ``bidirectional``
carries those [start, end) runs for the tokens of one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.models import gemma2
from engine.models.base import (
    NESTED_LM_PREFIXES,
    RoPE,
    layer_types,
    make_rope,
    rope_settings,
    strip_prefixes,
    text_config,
)
from engine.models.kv_cache import RotatingKVCache


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
    use_bidirectional_attention: bool = False  # EmbeddingGemma; read by engine/models/embedder.py

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
            return make_rope(
                self.head_dim, self.rope_local_base_freq, self.local_rope_scaling, self.max_position_embeddings
            )
        return make_rope(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)


class DecoderLayer(gemma2.DecoderLayer):
    qk_norm = True


def media_mask(cache: Any, n: int, window: int | None, blocks: list[tuple[int, int]]) -> mx.array:
    """Boolean [n, keys] mask: causal (within ``window``) OR both tokens in one block."""
    offset = int(cache.offset) if cache is not None else 0
    if isinstance(cache, RotatingKVCache):
        n_keys = min(offset, cache.max_size - 1) + n  # what its multi-token update returns
        window = cache.max_size if window is None else min(window, cache.max_size)
    else:
        n_keys = offset + n
    q = mx.arange(offset, offset + n)[:, None]
    k = (mx.arange(n_keys) + offset + n - n_keys)[None, :]
    allowed = k <= q
    for start, end in blocks:
        s, e = offset + start, offset + end
        allowed = allowed | ((q >= s) & (q < e) & (k >= s) & (k < e))
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed


class GemmaModel(gemma2.GemmaModel):
    layer_class = DecoderLayer

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        bidirectional: list[tuple[int, int]] | None = None,
    ) -> mx.array:
        if not bidirectional:
            return self.run(inputs, cache, input_embeddings)
        return self.run(
            inputs, cache, input_embeddings, make_mask=lambda n, c, window: media_mask(c, n, window, bidirectional)
        )


_OTHER_TOWERS = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "audio_tower.",
    "model.audio_tower.",
)


class Model(gemma2.Model):
    model_class = GemmaModel
    bidirectional_media = True  # the prompt builder passes each image's token run

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        bidirectional: list[tuple[int, int]] | None = None,
    ) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings, bidirectional))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(strip_prefixes(weights, NESTED_LM_PREFIXES, _OTHER_TOWERS))
