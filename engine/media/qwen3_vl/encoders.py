"""Qwen3-VL's image and video encoders: one tower, loaded once, serves both.

An image is one run of ``<|image_pad|>`` tokens. A video is sampled and preprocessed by
``processor.VideoProcessor``; each temporal patch (two frames) is a run of
``<|video_pad|>`` tokens after its timestamp, written exactly as transformers'
Qwen3VLProcessor writes it (``<0.5 seconds><|vision_start|>...<|vision_end|>``, inside the
template's own vision markers). Each run is encoded on its own (the tower attends within
a frame group, so that equals encoding the clip at once) and cached under the clip's
content hash and its number, so a continued chat never encodes a frame twice.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import mlx.core as mx

from engine.api import MediaInput
from engine.artifacts.config_values import check_processor_settings
from engine.errors import MediaError
from engine.files import SETTINGS_LIMIT, read_text_bounded
from engine.media.encoded_cache import media_key
from engine.media.image import Qwen2VLImageProcessor, load_image
from engine.media.prompt import PreparedMedia
from engine.media.qwen3_vl.processor import VideoProcessor
from engine.media.qwen3_vl.tower import RENAMES, VisionConfig, VisionModel, sanitize
from engine.media.towers import LazyTowerEncoder, TowerSource, dtype_bytes, read_image_preprocessor
from engine.media.video import duration_text, probe

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class Tower(LazyTowerEncoder):
    """The vision tower of one loaded model; its weights are read on the first encode."""

    renames = RENAMES
    what = "Qwen3-VL vision tower"
    # Settings a family's configs leave out because its tower differs (Qwen3.5: no DeepStack).
    defaults: dict[str, Any] = {}

    def __init__(self, source: TowerSource):
        self.source = source
        self.config = VisionConfig.from_dict({**self.defaults, **(source.config.raw.get("vision_config") or {})})
        self.module = None
        self.calls = 0

    def build(self) -> VisionModel:
        return VisionModel(self.config)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        # The tower computes in the language model's dtype (a float32 load of bf16 weights
        # runs both in float32).
        dtype = getattr(mx, self.source.dtype, None)
        weights = sanitize(weights, self.config)
        if isinstance(dtype, mx.Dtype):
            weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        return weights

    def run(self, module: VisionModel, item: PreparedMedia) -> mx.array:
        pixels, grid = item.data
        return module(mx.array(pixels), grid)


def shared_tower(source: TowerSource, tower_class: type[Tower] = Tower) -> Tower:
    """One tower per loaded model, shared by its image and video encoders. The source
    holds it weakly: it goes (weights and all) when the model's encoders do."""
    ref = source.__dict__.get("_qwen3_vl_tower")
    tower = ref() if ref is not None else None
    if tower is None:
        tower = tower_class(source)
        source.__dict__["_qwen3_vl_tower"] = weakref.ref(tower)
    return tower


class _Encoder:
    """What the image and video encoders share: the tower, the model's token ids."""

    kind = ""
    placeholder = ""
    tower_class = Tower
    default_token_ids = {"image": 151655, "video": 151656}  # when the config names none

    def __init__(self, source: TowerSource):
        self.source = source
        self.tower = shared_tower(source, self.tower_class)
        self.calls = 0
        raw = source.config.raw
        self.vision_config = self.tower.config
        self.token_ids = {
            name: int(raw.get(f"{name}_token_id", source.config.text.get(f"{name}_token_id", default)))
            for name, default in self.default_token_ids.items()
        }

    @property
    def token_id(self) -> int:
        return self.token_ids[self.kind]

    @property
    def loaded(self) -> bool:
        return self.tower.loaded

    def encode(self, item: PreparedMedia) -> mx.array:
        self.calls += 1
        return self.tower.encode(item)

    def max_tokens(self) -> int:
        """Soft tokens of the largest item the processor makes (its pixel budget)."""
        raise NotImplementedError

    def max_feature_bytes(self) -> int:
        """The tower's output for the largest item: its tokens, each out_hidden wide once
        for the merger and once per DeepStack layer, in the language model's dtype. The
        features cache is sized by it (engine/media/towers.py)."""
        cfg = self.vision_config
        width = cfg.out_hidden_size * (1 + len(cfg.deepstack_visual_indexes))
        return self.max_tokens() * width * dtype_bytes(self.source.dtype)

    def _key(self, item: MediaInput, settings: dict[str, Any]) -> str:
        return media_key(item, {**settings, "model": str(self.source.path), "tower": "qwen3_vl"})


class ImageEncoder(_Encoder):
    kind = "image"
    placeholder = IMAGE_PAD

    def __init__(self, source: TowerSource):
        super().__init__(source)
        cfg = self.vision_config
        pre = read_image_preprocessor(source)
        pre.setdefault("patch_size", cfg.patch_size)
        pre.setdefault("merge_size", cfg.spatial_merge_size)
        pre.setdefault("temporal_patch_size", cfg.temporal_patch_size)
        self.processor = Qwen2VLImageProcessor.from_config(pre)

    def max_tokens(self) -> int:
        p = self.processor
        return p.max_pixels // (p.patch_size * p.merge_size) ** 2

    def prepare(self, item: MediaInput) -> PreparedMedia:
        vision = self.processor([load_image(item.source)])
        t, h, w = (int(v) for v in vision.image_grid_thw[0])
        m = self.processor.merge_size
        n = t * h * w // (m * m)
        return PreparedMedia(
            kind="image",
            key=self._key(item, self.processor.settings()),
            n_tokens=n,
            text=IMAGE_PAD * n,
            data=(vision.pixel_values, (t, h, w)),
            grid=(t, h // m, w // m),
        )


def read_video_preprocessor(source: TowerSource) -> dict[str, Any]:
    """The video processor's settings as transformers finds them: processor_config.json's
    nested ``video_processor``, else video_preprocessor_config.json ({} when neither)."""
    for name, nested in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None)):
        path = source.path / name
        if not path.is_file():
            continue
        try:
            data = json.loads(read_text_bounded(path, SETTINGS_LIMIT, "a processor's settings", MediaError))
        except (OSError, ValueError) as e:
            raise MediaError(f"{path} cannot be read ({e}); download the model again.") from None
        data = data.get(nested) if nested and isinstance(data, dict) else data
        if isinstance(data, dict):
            check_processor_settings(data, str(path))
            return data
    return {}


class VideoEncoder(_Encoder):
    kind = "video"
    placeholder = VIDEO_PAD

    def __init__(self, source: TowerSource):
        super().__init__(source)
        cfg = self.vision_config
        pre = read_video_preprocessor(source)
        pre.setdefault("patch_size", cfg.patch_size)
        pre.setdefault("merge_size", cfg.spatial_merge_size)
        pre.setdefault("temporal_patch_size", cfg.temporal_patch_size)
        self.processor = VideoProcessor.from_config(pre)

    def max_tokens(self) -> int:
        # The pixel budget counts every frame; each temporal patch of frames is one group.
        p = self.processor
        return p.max_pixels // ((p.patch_size * p.merge_size) ** 2 * p.temporal_patch_size)

    def prepare(self, item: MediaInput) -> PreparedMedia:
        info = probe(item.source)
        indices = self.processor.sample(info.frames, info.fps)
        # Past the processor's frame limit the samples lie far apart: seek to each rather
        # than decode the whole clip (within it, decode in order as transformers does).
        sampled = self.processor.wanted(info.frames, info.fps) > self.processor.max_frames
        patches = self.processor.from_clip(item.source, indices, info.fps, seek=sampled)
        groups, h, w = patches.grid
        m = self.processor.merge_size
        per_group = h * w
        n = per_group // (m * m)
        key = self._key(item, self.processor.settings())
        views, text = [], []
        for g, seconds in enumerate(patches.timestamps):
            pixels = patches.pixel_values[g * per_group : (g + 1) * per_group]
            views.append(
                PreparedMedia(
                    kind="video",
                    key=f"{key}:{g}",
                    n_tokens=n,
                    text="",
                    data=(pixels, (1, h, w)),
                    grid=(1, h // m, w // m),
                )
            )
            text.append(f"<{seconds:.1f} seconds>{VISION_START}{VIDEO_PAD * n}{VISION_END}")
        note = _sampled_note(info.seconds, len(patches.indices), self.processor.fps) if sampled else ""
        return PreparedMedia(
            kind="video", key=key, n_tokens=n * groups, text="".join(text), data=None, views=views, note=note
        )


def _sampled_note(seconds: float, frames: int, fps: float) -> str:
    # By its length, not its name: the app keeps attachments under content hashes.
    return (
        f"A video of {duration_text(seconds)} is longer than the model takes at {fps:g} frames a second: "
        f"it was sampled to {frames} frames over its whole duration (one every {seconds / max(frames, 1):.1f} s)."
    )


def make_encoder(source: TowerSource) -> ImageEncoder:
    return ImageEncoder(source)


def make_video_encoder(source: TowerSource) -> VideoEncoder:
    return VideoEncoder(source)
