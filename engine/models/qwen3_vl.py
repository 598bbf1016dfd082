"""Qwen3-VL's language model: Qwen3 with interleaved multimodal RoPE and DeepStack.

Positions work as in Qwen2.5-VL (``qwen2_5_vl``: three ids per token, ``rope_index``),
except that the rotary frequencies are shared out between time, height and width in
turn (t, h, w, t, h, w, ...) rather than in three blocks. A video is a run of frames,
each its own image-like grid of tokens after a timestamp, so ``rope_index`` sees one
span per frame.

DeepStack: the vision tower also hands over features taken from a few of its middle
blocks; they are added to the hidden states of the visual tokens after the first
decoder layers (the k-th feature after layer k). The engine passes them inside the
input embeddings: an image's rows are ``hidden * (1 + k)`` wide (the embedding, then each
DeepStack feature) and text rows carry zeros there, so adding them leaves text exact.

Weights: ``model.language_model.*`` (transformers 5), ``language_model.model.*`` (mlx-vlm) or
``model.*``; ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import qwen2_5_vl, qwen3


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "qwen3_vl"
    rope_theta: float = 500_000.0
    max_position_embeddings: int = 128000
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        flat, section = qwen2_5_vl.split_mrope(config)
        config = super().normalise(flat)
        if section is not None:
            config["mrope_section"] = section
        return config


def split_deepstack(embeddings: mx.array | None, hidden: int) -> tuple[mx.array | None, list[mx.array]]:
    """(the embeddings proper, the DeepStack features) of input embeddings that may be wider
    than ``hidden`` (see the module docstring)."""
    if embeddings is None or embeddings.shape[-1] == hidden:
        return embeddings, []
    parts = [embeddings[..., i : i + hidden] for i in range(0, embeddings.shape[-1], hidden)]
    return parts[0], parts[1:]


class DecoderLayer(qwen2_5_vl.DecoderLayer):
    interleaved = True

    def __init__(self, args: ModelArgs, window: int | None, index: int):
        self.index = index  # before the base builds the MLP, which may depend on it (MoE)
        super().__init__(args, window)

    def __call__(
        self, x: mx.array, mask, cache, position_ids: mx.array | None = None, deepstack: list[mx.array] = ()
    ) -> mx.array:
        out = super().__call__(x, mask, cache, position_ids)
        return out + deepstack[self.index] if self.index < len(deepstack) else out


class Qwen3VLModel(qwen2_5_vl.QwenVLModel):
    layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.hidden_size = args.hidden_size

    def make_layer(self, args: ModelArgs, index: int, window: int | None) -> nn.Module:
        return self.layer_class(args, window, index)

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        embeddings, deepstack = split_deepstack(input_embeddings, self.hidden_size)
        return self.run(inputs, cache, embeddings, position_ids=position_ids, deepstack=deepstack)


# The tower's weights, left for engine/media/qwen3_vl (mlx-vlm names it vision_tower).
_TOWER = ("visual.", "model.visual.", "vision_tower.")


class Model(qwen2_5_vl.Model):
    model_class = Qwen3VLModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize({k: v for k, v in weights.items() if not k.startswith(_TOWER)})
