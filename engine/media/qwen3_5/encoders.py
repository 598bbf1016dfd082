"""Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe``) images and video.

The tower is Qwen3-VL's (engine/media/qwen3_vl/tower.py: interpolated position table,
2-D rotary, per-frame attention, the same merger), and so are the processors and the
prompt text (timestamps before each frame group). What differs:

* no DeepStack: transformers' Qwen3_5VisionConfig has no ``deepstack_visual_indexes``
  (a saved config lacks the key; the published ones write ``[]``), so the tower's output
  is the merged features alone and the language model takes plain embeddings;
* the soft-token ids default to Qwen3.5's vocabulary (248056 image, 248057 video).
"""

from __future__ import annotations

from typing import Any

from engine.media.qwen3_vl import encoders
from engine.media.towers import TowerSource

TOKEN_IDS = {"image": 248056, "video": 248057}


class Tower(encoders.Tower):
    what = "Qwen3.5 vision tower"
    defaults: dict[str, Any] = {"deepstack_visual_indexes": ()}


class ImageEncoder(encoders.ImageEncoder):
    tower_class = Tower
    default_token_ids = TOKEN_IDS


class VideoEncoder(encoders.VideoEncoder):
    tower_class = Tower
    default_token_ids = TOKEN_IDS


def make_encoder(source: TowerSource) -> ImageEncoder:
    return ImageEncoder(source)


def make_video_encoder(source: TowerSource) -> VideoEncoder:
    return VideoEncoder(source)
