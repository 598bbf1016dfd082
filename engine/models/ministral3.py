"""Ministral 3, and the language model of ``mistral3`` checkpoints (text part only).

Llama layers with YaRN RoPE and one addition: queries are scaled by a factor that grows
with the position, ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
(``llama_4_scaling_beta``), so attention stays sharp far past the pretraining length.
Both the transformers 5 spelling (inside ``rope_parameters``) and the older one
(``rope_scaling``, or top-level keys) are read. A mistral3 wrapper whose text model is
plain ``mistral`` (Mistral Small 3.x) runs as Mistral. The vision tower's weights are
left out here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from engine.models import base, llama

# transformers' Ministral3Config uses this RoPE when a config names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "ministral3"
    vocab_size: int = 131072
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    llama_4_scaling_beta: float | None = None
    original_max_position_embeddings: int | None = None

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        if isinstance(config.get("text_config"), dict):
            # The wrapper owns the output head, so its own setting (default: tied) decides.
            wrapper_ties = bool(config.get("tie_word_embeddings", True))
            config = base.text_config(config)
            config["tie_word_embeddings"] = wrapper_ties
        ministral = config.get("model_type") == "ministral3"
        if ministral and not config.get("rope_parameters") and not config.get("rope_scaling"):
            config["rope_parameters"] = dict(DEFAULT_ROPE)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        for key in ("llama_4_scaling_beta", "original_max_position_embeddings"):
            if key in rope and config.get(key) is None:
                config[key] = rope[key]
        return super().normalise(config)

    def layer_windows(self) -> list[int | None]:
        # Like Mistral: a window, when set, applies to every layer (layer_types is ignored).
        return [self.sliding_window] * self.num_hidden_layers


class Attention(base.Attention):
    """Attention whose queries are scaled by the position-dependent factor above."""

    def __init__(self, args: ModelArgs, rope: base.RoPE):
        super().__init__(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, rope)
        self.beta = float(args.llama_4_scaling_beta)
        self.original = float(args.original_max_position_embeddings)

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = base.rotated_qkv(self, x, offset)
        positions = mx.arange(x.shape[1]) + offset
        scale = 1 + self.beta * mx.log(1 + mx.floor(positions / self.original))
        return q * scale[:, None].astype(q.dtype), k, v


class DecoderLayer(llama.DecoderLayer):
    def make_attention(self, args: ModelArgs, rope: base.RoPE) -> nn.Module:
        if args.llama_4_scaling_beta is None or args.original_max_position_embeddings is None:
            return super().make_attention(args, rope)
        return Attention(args, rope)


class Ministral3Model(llama.LlamaModel):
    layer_class = DecoderLayer


class Model(llama.Model):
    model_class = Ministral3Model

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = base.strip_prefixes(weights, base.NESTED_LM_PREFIXES, drop=TOWER_PREFIXES)
        return super().sanitize(weights)
