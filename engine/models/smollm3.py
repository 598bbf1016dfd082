"""SmolLM3: Llama layers, some of which use no positional encoding at all (NoPE).

``no_rope_layers`` holds 1 for a layer with RoPE and 0 for a NoPE layer; without it,
every ``no_rope_layer_interval``-th layer is NoPE. With ``use_sliding_window`` the NoPE
layers (the ones ``layer_types`` calls sliding) attend over ``sliding_window`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from engine.models import llama
from engine.models.base import RoPE, layer_types


def no_rotation(dims: int) -> RoPE:
    """A RoPE whose wavelengths are infinite: every angle is 0, so it returns its input
    exactly. Being a plain RoPE, it keeps NoPE layers on the compiled decode path."""
    return RoPE(dims, None, freqs=mx.full((dims // 2,), mx.inf))


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "smollm3"
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.no_rope_layers is None:
            self.no_rope_layers = [
                int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_hidden_layers)
            ]

    def uses_rope(self, index: int) -> bool:
        return bool(self.no_rope_layers[index])

    def default_layer_types(self) -> list[str]:
        slide = self.use_sliding_window and self.sliding_window is not None
        return [
            "sliding_attention" if slide and not self.uses_rope(i) else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def layer_windows(self) -> list[int | None]:
        if not (self.use_sliding_window and self.sliding_window):
            return [None] * self.num_hidden_layers
        kinds = layer_types({"layer_types": self.layer_types}, self.num_hidden_layers, self.default_layer_types())
        return [self.sliding_window if k == "sliding_attention" else None for k in kinds]


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, args: ModelArgs, window: int | None, index: int):
        super().__init__(args, window)
        if not args.uses_rope(index):
            self.self_attn.rope = no_rotation(args.head_dim)


class SmolLM3Model(llama.LlamaModel):
    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return DecoderLayer(args, window, index)


class Model(llama.Model):
    model_class = SmolLM3Model
