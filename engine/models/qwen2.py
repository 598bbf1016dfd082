"""Qwen2 / Qwen2.5: the Llama layout with biases on the q, k and v projections (not o)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen2"
    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    sliding_window: int | None = 4096
    max_window_layers: int | None = 28

    qkv_bias = True
    o_bias = False


class Model(llama.Model):
    pass
