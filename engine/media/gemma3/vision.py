"""Gemma 3's image path: SigLIP tower + multimodal projector, and the prompt it needs.

The projector average-pools the tower's patch grid down to ``mm_tokens_per_image``
tokens (16x16 for 256), applies Gemma's RMSNorm (scale 1 + w) and projects into the
language model's width. In the prompt, the template's ``<start_of_image>`` becomes
``\\n\\n<start_of_image>`` + that many ``<image_soft_token>`` + ``<end_of_image>\\n\\n``,
as transformers' Gemma3Processor writes it; the language model then lets the soft
tokens of one image attend to each other both ways (see engine/models/gemma3.py).

Pan-and-scan (``do_pan_and_scan`` in the model's processor config, or per request) shows a
wide or tall image as the whole plus up to a few crops, each its own run of soft tokens,
with the processor's sentence around them. Each view is encoded and cached on its own,
keyed by the image bytes and its crop box, so two crops never share an encoding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.api import MediaInput
from engine.errors import MediaError
from engine.media.encoded_cache import media_key
from engine.media.image import Gemma3ImageProcessor, load_image
from engine.media.prompt import PreparedMedia
from engine.media.siglip import SiglipVisionConfig, SiglipVisionTransformer, sanitize
from engine.media.towers import LazyTowerEncoder, TowerSource, read_image_preprocessor

BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
# The words transformers' Gemma3Processor writes around the views of a pan-and-scanned image.
ORIGINAL_INTRO = "Here is the original image "
CROPS_INTRO = " and here are some crops to help you see better "


def pan_and_scan_text(image_sequence: str, crops: int) -> str:
    """What replaces the template's image placeholder for an image shown with ``crops`` crops."""
    if not crops:
        return image_sequence
    return ORIGINAL_INTRO + image_sequence + CROPS_INTRO + " ".join([image_sequence] * crops)


# Checkpoint spellings: the published checkpoints nest SigLIP as vision_tower.vision_model,
# later transformers versions save it flat (vision_tower.*) or under model.
_RENAMES = (
    ("model.vision_tower.vision_model.", "vision_model."),
    ("vision_tower.vision_model.", "vision_model."),
    ("model.vision_tower.", "vision_model."),
    ("vision_tower.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


class MultiModalProjector(nn.Module):
    def __init__(self, vision: SiglipVisionConfig, text_hidden: int, tokens_per_image: int):
        super().__init__()
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = _GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.side = vision.patches_per_side
        per_side = int(round(tokens_per_image**0.5))
        if per_side * per_side != tokens_per_image or self.side % per_side:
            raise MediaError(
                f"mm_tokens_per_image={tokens_per_image} does not pool evenly from a {self.side}x{self.side} "
                "patch grid; the model's config is inconsistent."
            )
        self.kernel = self.side // per_side

    def __call__(self, x: mx.array) -> mx.array:
        n, _, d = x.shape
        s, k = self.side, self.kernel
        pooled = x.reshape(n, s // k, k, s // k, k, d).mean(axis=(2, 4)).reshape(n, -1, d)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).astype(x.dtype)


class _GemmaRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x.astype(mx.float32), 1.0 + self.weight.astype(mx.float32), self.eps)
        return y.astype(x.dtype)


class Gemma3Vision(nn.Module):
    def __init__(self, vision: SiglipVisionConfig, text_hidden: int, tokens_per_image: int):
        super().__init__()
        self.vision_model = SiglipVisionTransformer(vision)
        self.multi_modal_projector = MultiModalProjector(vision, text_hidden, tokens_per_image)

    def __call__(self, pixels: mx.array) -> mx.array:
        """pixel_values (N, 3, S, S) -> (N, mm_tokens_per_image, text hidden)."""
        return self.multi_modal_projector(self.vision_model(pixels))


class Gemma3VisionEncoder(LazyTowerEncoder):
    kind = "image"
    placeholder = BOI
    renames = _RENAMES
    what = "Gemma 3 vision tower"

    def __init__(self, source: TowerSource):
        raw = source.config.raw
        self.source = source
        self.vision_config = SiglipVisionConfig.from_dict(raw.get("vision_config") or {})
        self.tokens = int(raw.get("mm_tokens_per_image") or 256)
        self.token_id = int(raw.get("image_token_index", raw.get("image_token_id", 262144)))
        self.text_hidden = int(source.config.text.get("hidden_size") or raw.get("hidden_size"))
        pre = read_image_preprocessor(source)
        if not pre:
            pre = {"size": {"height": self.vision_config.image_size, "width": self.vision_config.image_size}}
        self.processor = Gemma3ImageProcessor.from_config(pre)
        self.module: Gemma3Vision | None = None
        self.calls = 0

    @property
    def pan_and_scan(self) -> bool:
        """Whether images are pan-and-scanned when a request does not say."""
        return self.processor.pan_and_scan

    def prepare(self, item: MediaInput) -> PreparedMedia:
        image = load_image(item.source)
        processor = self.processor
        if item.pan_and_scan is not None and item.pan_and_scan != processor.pan_and_scan:
            processor = replace(processor, pan_and_scan=item.pan_and_scan)
        boxes: list[tuple[int, int, int, int] | None] = [None, *processor.crop_boxes(image.width, image.height)]
        settings = {**processor.settings(), "model": str(self.source.path), "tower": "gemma3"}
        whole = media_key(item, settings)
        sequence = f"\n\n{BOI}{SOFT * self.tokens}{EOI}\n\n"
        views = []
        for box in boxes:
            pixels = processor([image if box is None else image.crop(box)])
            # The whole image keys the same with or without crops: its pixels are the same.
            key = whole if box is None else media_key(whole.encode(), {"crop": list(box)})
            views.append(PreparedMedia(kind="image", key=key, n_tokens=self.tokens, text=sequence, data=pixels))
        if len(views) == 1:
            return views[0]
        return PreparedMedia(
            kind="image",
            key=media_key(whole.encode(), {"crops": [list(b) for b in boxes[1:]]}),
            n_tokens=self.tokens * len(views),
            text=pan_and_scan_text(sequence, len(views) - 1),
            data=None,
            views=views,
        )

    def build(self) -> Gemma3Vision:
        return Gemma3Vision(self.vision_config, self.text_hidden, self.tokens)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return sanitize(weights, self.vision_config)

    def run(self, module: Gemma3Vision, item: PreparedMedia) -> mx.array:
        return module(mx.array(item.data))[0]


def make_encoder(source: TowerSource) -> Gemma3VisionEncoder:
    return Gemma3VisionEncoder(source)
