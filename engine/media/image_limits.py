"""How big an image may be, and how small it is decoded.

No model's processor wants more than about 12.8 megapixels (Qwen2.5-VL's largest
setting; Gemma 3 and SigLIP want under one), so a larger photo is decoded reduced:
JPEGs at 1/2, 1/4 or 1/8 scale inside libjpeg (Pillow's ``draft``), other formats
reduced by a whole factor right after decoding (``reduce``). Images past MAX_PIXELS are
refused from their header, before a byte of pixels is decoded.
"""

from __future__ import annotations

import math

from PIL import Image

from engine.errors import MediaError

MAX_PIXELS = 120_000_000  # refused above this: 120 megapixels, larger than any camera's photo
MAX_DECODED_PIXELS = 16_000_000  # decoded at most this large (every processor resizes below it)


def check_pixels(im: Image.Image, name: str) -> None:
    """Refuse an image whose header claims more than MAX_PIXELS."""
    width, height = im.size
    if width * height > MAX_PIXELS:
        raise MediaError(
            f"Image {name} is {width:,}×{height:,} ({width * height / 1e6:,.0f} megapixels); images "
            f"up to {MAX_PIXELS / 1e6:,.0f} megapixels can be sent: scale it down first."
        )


def draft_reduced(im: Image.Image) -> None:
    """Before ``load``: ask a JPEG's decoder for a smaller scale when the image is large."""
    width, height = im.size
    if im.format == "JPEG" and width * height > MAX_DECODED_PIXELS:
        scale = math.sqrt(MAX_DECODED_PIXELS / (width * height))
        # draft picks the smallest scale that is still at least this size
        im.draft("RGB", (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))))


def reduced(im: Image.Image) -> Image.Image:
    """After ``load``: a whole-factor box reduction down to MAX_DECODED_PIXELS at most."""
    width, height = im.size
    if width * height <= MAX_DECODED_PIXELS:
        return im
    factor = math.ceil(math.sqrt(width * height / MAX_DECODED_PIXELS))
    return im.reduce(factor)
