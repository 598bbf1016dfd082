"""The media towers of one loaded model, found by model_type and loaded only when used.

``MediaTowers`` knows at model load which kinds of media the model takes (from its
config and this registry) without reading a byte of tower weights. The first request
with an image builds the encoder and loads its weights from the model's own safetensors
files; text-only chats never do. Encoded features are kept in an ``EncodedMediaCache``
keyed by content hash, so a regenerated or continued chat does not encode again.

Preparing an item (decoding a clip, sampling, resizing and patching its frames; decoding
audio into features) is remembered too: what the prompt needs of it (soft-token counts,
grids, the text with its timestamps, the content keys) is kept without the tower's input,
under a hash of the file's bytes and every setting that changes the result. A follow-up
turn about the same clip hashes the file (cheap next to decoding it), finds the features
in the cache and runs neither the decoder nor the tower.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

from engine.api import MediaInput, MemoryPlan, VideoLimits
from engine.artifacts.config_values import check_processor_settings
from engine.errors import MediaError
from engine.files import SETTINGS_LIMIT, read_text_bounded
from engine.media.encoded_cache import EncodedMediaCache, HashedInput, content_digest, media_key
from engine.media.prompt import MediaEncoder, PreparedMedia
from engine.models.families import FAMILIES

# model_type -> {kind: module}, from the family manifest (engine.models.families); the
# module offers make_encoder(source) -> MediaEncoder ("module:function" names another
# factory in it).
TOWERS: dict[str, dict[str, str]] = {t: dict(f.towers) for t, f in FAMILIES.items() if f.towers}

# What to suggest when a model cannot take a kind of media.
SUGGESTIONS = {
    "image": ("cannot read images", "pick a vision model such as Gemma 3 or Qwen2.5-VL"),
    "audio": ("cannot hear audio", "transcribe it first or pick an audio model such as Qwen2-Audio"),
    "video": ("cannot watch video", "pick a model of a family that can: {families}"),
}

# The features cache's budget follows the loaded model (``features_cache_bytes``): room for
# FEATURE_ITEMS items of the largest its towers give, as their encoders estimate it from
# their settings (at Qwen3-VL-4B's a 30 s 720p clip's features, DeepStack included, are
# ~240 MB, a photo at the pixel limit ~335 MB), and never less than the DEFAULT_CACHE_BYTES
# every model had before (towers that give no estimate keep it); but never more than
# FEATURES_SHARE of the memory budget, nor ROOM_SHARE of what the budget leaves beside the
# weights, which is the KV cache's room.
DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
FEATURE_ITEMS = 3  # two clips in a chat and a photo
FEATURES_SHARE = 0.1
ROOM_SHARE = 0.25
# Prepared items kept for follow-up turns, counted by their prompt text (a 30 s clip at
# Qwen3-VL's settings writes ~100 KB of it): 16 MiB holds a long chat's worth. Their
# pixels and audio features are never kept (a 30 s 720p clip's patches are ~300 MB); the
# tower's output they stand for stays in the features cache above, whose budget bounds it.
PREPARED_CACHE_BYTES = 16 * 1024 * 1024


def features_cache_bytes(item_bytes: int, plan: MemoryPlan | None) -> int:
    """The features cache's budget (the rule above) for a model whose largest item gives
    ``item_bytes`` of features (0: unknown), under its memory ``plan`` (None: no bound)."""
    want = max(DEFAULT_CACHE_BYTES, FEATURE_ITEMS * int(item_bytes))
    if plan is None or plan.budget_bytes <= 0:
        return want
    room = max(0, plan.budget_bytes - plan.weights_bytes)
    return int(min(want, FEATURES_SHARE * plan.budget_bytes, ROOM_SHARE * room))


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of an activation dtype named as TowerSource.dtype names it."""
    return 4 if dtype == "float32" else 2


@dataclass
class TowerSource:
    """Where a tower's settings and weights come from: the loaded model's folder."""

    name: str
    path: Path  # the model folder
    config: Any  # ModelConfig
    model: Any  # the language model (its embeddings and dtype)
    dtype: str  # activation dtype of the language model

    def weight_files(self) -> list[Path]:
        from engine.artifacts.weights import find_weights

        return find_weights(self.path)


def load_tower_weights(source: TowerSource, renames: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The tensors whose names start with one of ``renames``' prefixes (first match
    renamed to its replacement), read lazily from the model's safetensors files;
    MediaError when there are none."""
    from engine.artifacts.weights import load_weights

    out: dict[str, Any] = {}
    for name, value in load_weights(source.weight_files()).items():
        for old, new in renames:
            if name.startswith(old):
                out[new + name[len(old) :]] = value
                break
    if not out:
        looked = ", ".join(old for old, _ in renames)
        raise MediaError(
            f"{source.name} declares a media tower but its weights hold none (looked for {looked}); "
            "download the full model, not a text-only conversion."
        )
    return out


def fill_tower(module: Any, weights: dict[str, Any], source: TowerSource, what: str) -> None:
    """Quantize like the checkpoint where it stores scales, load strictly, evaluate."""
    import mlx.core as mx

    from engine.errors import ModelLoadError
    from engine.models.checkpoint import quantize_like_checkpoint

    quantize_like_checkpoint(module, set(weights), source.config.quantization, name=source.name)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        text = " ".join(str(e).split())[:300]
        raise ModelLoadError(f"{source.name}: the {what} weights do not match its config ({text}).") from None
    mx.eval(module.parameters())
    module.eval()


def read_preprocessor(source: TowerSource) -> dict[str, Any]:
    """The model's preprocessor_config.json as a dict ({} when absent); MediaError when unreadable."""
    import json

    path = source.path / "preprocessor_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text_bounded(path, SETTINGS_LIMIT, "a processor's settings", MediaError))
    except (OSError, ValueError) as e:
        raise MediaError(f"{path} cannot be read ({e}); download the model again.") from None
    if isinstance(data, dict):
        check_processor_settings(data, str(path))
    return data if isinstance(data, dict) else {}


def read_image_preprocessor(source: TowerSource) -> dict[str, Any]:
    """The image processor's settings as transformers finds them: processor_config.json's
    nested ``image_processor`` when it has one, else preprocessor_config.json ({} when
    neither); MediaError when unreadable."""
    return read_nested_preprocessor(source, "image_processor")


def read_nested_preprocessor(source: TowerSource, part: str) -> dict[str, Any]:
    """One part's settings (``image_processor``, ``feature_extractor``) as transformers
    finds them: nested in processor_config.json, else preprocessor_config.json."""
    import json

    path = source.path / "processor_config.json"
    if path.is_file():
        try:
            data = json.loads(read_text_bounded(path, SETTINGS_LIMIT, "a processor's settings", MediaError))
        except (OSError, ValueError) as e:
            raise MediaError(f"{path} cannot be read ({e}); download the model again.") from None
        nested = data.get(part) if isinstance(data, dict) else None
        if isinstance(nested, dict):
            check_processor_settings(nested, f"{path} ({part})")
            return nested
    return read_preprocessor(source)


class LazyTowerEncoder:
    """What every tower encoder shares: its module is built and its weights read on the
    first ``encode`` (or ``load``), and encodes are counted. Subclasses set ``source``,
    ``renames`` and ``what``, and provide ``build``, ``sanitize`` and ``run``."""

    renames: Sequence[tuple[str, str]] = ()
    what = "media tower"  # for load errors: "the <what> weights do not match ..."
    module: Any = None
    calls = 0
    source: TowerSource

    def build(self) -> Any:
        """The tower module, with its parameters not yet loaded."""
        raise NotImplementedError

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return weights

    def run(self, module: Any, item: PreparedMedia) -> Any:
        """The tower's output for one prepared item."""
        raise NotImplementedError

    @property
    def loaded(self) -> bool:
        return self.module is not None

    def load(self) -> Any:
        if self.module is None:
            module = self.build()
            weights = self.sanitize(load_tower_weights(self.source, self.renames))
            fill_tower(module, weights, self.source, self.what)
            self.module = module
        return self.module

    def encode(self, item: PreparedMedia) -> Any:
        module = self.load()
        self.calls += 1
        return self.run(module, item)


def prepare_settings(encoder: Any) -> dict[str, Any]:
    """Everything besides an item's bytes that changes what ``encoder.prepare`` gives: the
    encoder (its family and kind), the model folder, and its processor's settings (frame
    rate and limits, pixel budgets, mel bins...). An encoder may say so itself with a
    ``prepare_settings()`` method."""
    own = getattr(encoder, "prepare_settings", None)
    if callable(own):
        return dict(own())
    source = getattr(encoder, "source", None)
    out: dict[str, Any] = {
        "encoder": f"{type(encoder).__module__}.{type(encoder).__qualname__}",
        "model": str(getattr(source, "path", "")),
    }
    for name in ("processor", "features", "config", "vision_config", "tokens"):
        part = getattr(encoder, name, None)
        settings = getattr(part, "settings", None)
        if callable(settings):
            out[name] = settings()
        elif is_dataclass(part) and not isinstance(part, type):
            out[name] = asdict(part)
        elif isinstance(part, int | float | str):
            out[name] = part
    return out


def _without_input(item: PreparedMedia) -> PreparedMedia:
    """What a follow-up turn needs of a prepared item: all but the tower's input."""
    return replace(item, data=None, encoded=None, again=None, views=[_without_input(v) for v in item.views])


def _text_bytes(item: PreparedMedia) -> int:
    return len(item.text) + len(item.key) + 256 + sum(_text_bytes(v) for v in item.views)


def families_for(kind: str) -> list[str]:
    """The model_types whose towers take ``kind``, for refusals that say where to go."""
    return sorted(t for t, kinds in TOWERS.items() if kind in kinds)


def supported_kinds(config: Any) -> set[str]:
    kinds = set(TOWERS.get(getattr(config, "model_type", ""), {}))
    if not getattr(config, "vision", False):
        kinds.discard("image")
        kinds.discard("video")
    if not getattr(config, "audio", False):
        kinds.discard("audio")
    return kinds


class MediaTowers:
    def __init__(
        self, source: TowerSource | None, *, plan: MemoryPlan | None = None, cache_bytes: int | None = None
    ) -> None:
        """``plan``: the loaded model's memory plan, which bounds the features cache (see
        ``features_cache_bytes``); ``cache_bytes`` sets that budget outright instead."""
        self.source = source
        self.kinds: frozenset[str] = frozenset(
            supported_kinds(source.config) if source is not None and source.path.is_dir() else ()
        )
        self._encoders: dict[str, MediaEncoder] = {}
        self._budget_set = cache_bytes is not None  # outright: it stays whatever the plan
        if cache_bytes is None:
            cache_bytes = features_cache_bytes(self.largest_item_bytes(), plan)
        self.cache: EncodedMediaCache[Any] = EncodedMediaCache(cache_bytes)
        # Prepared items without their tower input, by content and settings (see the top).
        self.prepared: EncodedMediaCache[PreparedMedia] = EncodedMediaCache(PREPARED_CACHE_BYTES, _text_bytes)
        self.prepare_calls = 0  # items prepared afresh (decoded, resized, patched)

    def follow_plan(self, plan: MemoryPlan | None) -> None:
        """The loaded model's memory plan changed (its built-in MTP layer was read: more
        weights, less room beside them): the features cache's budget follows, the least
        recently used features evicted where they no longer fit."""
        if not self._budget_set:
            self.cache.resize(features_cache_bytes(self.largest_item_bytes(), plan))

    @property
    def name(self) -> str:
        return self.source.name if self.source is not None else "this model"

    def check(self, kinds: Iterable[str]) -> None:
        """Refuse, before anything runs, media this model cannot take."""
        for kind in sorted(set(kinds)):
            if kind not in self.kinds:
                what, advice = SUGGESTIONS.get(kind, (f"cannot take {kind}", "pick another model"))
                advice = advice.format(families=", ".join(families_for(kind)))
                raise MediaError(f"This model ({self.name}) {what}; {advice}.")

    def encoder(self, kind: str) -> MediaEncoder:
        self.check([kind])
        enc = self._encoders.get(kind)
        if enc is None:
            name, _, factory = TOWERS[self.source.config.model_type][kind].partition(":")
            enc = getattr(importlib.import_module(name), factory or "make_encoder")(self.source)
            self._encoders[kind] = enc
        return enc

    def largest_item_bytes(self) -> int:
        """The most features one item can give, over the kinds this model takes, as their
        encoders estimate it from their settings (``max_feature_bytes``; no weights read);
        0 when none does."""
        sizes = [0]
        for kind in sorted(self.kinds):
            try:
                estimate = getattr(self.encoder(kind), "max_feature_bytes", None)
                sizes.append(int(estimate()) if callable(estimate) else 0)
            except Exception:  # noqa: BLE001 - a tower that cannot be set up says why when first used
                continue
        return max(sizes)

    @property
    def loaded(self) -> bool:
        """Whether any tower's weights are in memory."""
        return any(e.loaded for e in self._encoders.values())

    @property
    def encode_calls(self) -> int:
        return sum(e.calls for e in self._encoders.values())

    def prepare(self, items: Sequence[MediaInput]) -> list[PreparedMedia]:
        self.check(m.kind for m in items)
        return [self._prepare(m) for m in items]

    def _prepare(self, item: MediaInput) -> PreparedMedia:
        """One item as its encoder prepares it, or, when the same bytes were prepared under
        the same settings, that preparation again: each run carries the tower's output when
        it is still cached (no decoding, no tower), else a way to prepare the item afresh,
        taken only if the tower must run for it (a run inside the KV cache's prefix never
        needs it; a clip is then decoded once for all its runs)."""
        encoder = self.encoder(item.kind)
        settings = {"kind": item.kind, "pan_and_scan": item.pan_and_scan, **prepare_settings(encoder)}
        # The file is read for hashing once: the encoder keys its features by this digest.
        hashed = HashedInput(item.kind, item.source, item.pan_and_scan, digest=content_digest(item.source))
        key = media_key(hashed, settings)
        known = self.prepared.get(key)
        if known is None:
            return self._prepare_afresh(encoder, hashed, key)
        # Prepared again later (its features evicted), the file is hashed again: what is
        # read then must be what this key stands for (``_with_input`` checks).
        fresh = functools.cache(lambda: self._prepare_afresh(encoder, item, key))

        def remembered(run: PreparedMedia, index: int) -> PreparedMedia:
            encoded = self.cache.get(run.key)
            again = None if encoded is not None else lambda: fresh().runs()[index]
            return replace(run, encoded=encoded, again=again)

        if not known.views:
            return remembered(known, 0)
        return replace(known, views=[remembered(v, i) for i, v in enumerate(known.views)])

    def _prepare_afresh(self, encoder: MediaEncoder, item: MediaInput, key: str) -> PreparedMedia:
        prepared = encoder.prepare(item)
        self.prepare_calls += 1
        self.prepared.put(key, _without_input(prepared))
        return prepared

    def pan_and_scan(self) -> bool | None:
        """Whether this model's images are pan-and-scanned by default; None when its image
        tower cannot crop (or its processor config is unreadable: images will say why)."""
        if "image" not in self.kinds:
            return None
        try:
            default = getattr(self.encoder("image"), "pan_and_scan", None)
        except MediaError:
            return None
        return default if isinstance(default, bool) else None

    def video_limits(self) -> VideoLimits | None:
        """How this model's video processor samples a clip (for the note at the drop); None
        when it takes no video (or its processor config is unreadable: video will say why).
        Reads the processor's settings only: the tower's weights stay unloaded."""
        if "video" not in self.kinds:
            return None
        try:
            processor = getattr(self.encoder("video"), "processor", None)
        except MediaError:
            return None
        fps, max_frames = getattr(processor, "fps", None), getattr(processor, "max_frames", None)
        if not isinstance(fps, int | float) or not isinstance(max_frames, int) or fps <= 0 or max_frames <= 0:
            return None
        return VideoLimits(float(fps), max_frames)

    def placeholders(self) -> dict[str, str]:
        return {k: e.placeholder for k, e in self._encoders.items()}

    def token_ids(self) -> dict[str, int]:
        return {k: e.token_id for k, e in self._encoders.items()}

    def features(self, item: PreparedMedia) -> Any:
        """The tower's output for one item (n_tokens, hidden), from the cache when seen before."""
        if item.encoded is not None:  # a follow-up turn's item carries it (see _prepare)
            return item.encoded
        return self.cache.get_or_compute(item.key, lambda: self._encode(self._with_input(item)))

    def _with_input(self, item: PreparedMedia) -> PreparedMedia:
        """The item with its tower input: a remembered one whose output was evicted is
        prepared afresh (and must still be the same content)."""
        if item.data is not None or item.again is None:
            return item
        fresh = item.again()
        if fresh.key != item.key:
            raise MediaError(f"The {item.kind} file changed while it was being read; attach it again.")
        return fresh

    def _encode(self, item: PreparedMedia) -> Any:
        import mlx.core as mx

        out = self.encoder(item.kind).encode(item)
        if out.shape[0] != item.n_tokens:
            raise MediaError(f"The {item.kind} tower gave {out.shape[0]} features for {item.n_tokens} tokens.")
        mx.eval(out)
        return out

    def unload(self) -> None:
        self._encoders.clear()
        self.cache.clear()
        self.prepared.clear()
