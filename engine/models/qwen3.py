"""Qwen3 (dense): the Llama layout with an RMSNorm over each query and key head."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3"
    vocab_size: int = 151936
    head_dim: int | None = 128  # transformers' default; not hidden / heads
    max_position_embeddings: int = 32768
    sliding_window: int | None = 4096
    max_window_layers: int | None = 28

    qk_norm = True


class Model(llama.Model):
    pass
