"""DiffusionGemma's image input: Gemma 4's vision tower and processor as they are
(transformers builds the tower from a ``gemma4_vision`` config and processes with
Gemma4Processor), read from where its checkpoint keeps them, inside the prompt
encoder (``model.encoder.vision_tower.``, ``model.encoder.embed_vision.``)."""

from __future__ import annotations

from engine.media.gemma4.vision import Gemma4VisionEncoder
from engine.media.towers import TowerSource


class DiffusionGemmaVisionEncoder(Gemma4VisionEncoder):
    renames = (
        ("model.encoder.vision_tower.", "vision_tower."),
        ("model.encoder.embed_vision.", "embed_vision."),
    )
    what = "DiffusionGemma vision tower"


def make_encoder(source: TowerSource) -> DiffusionGemmaVisionEncoder:
    return DiffusionGemmaVisionEncoder(source)
