"""A follow-up turn about media already in the chat neither decodes nor encodes it again.

Every turn renders the whole conversation, so the clip (or photo, or voice note) of the
first message comes back with each follow-up question. Its preparation is remembered by
the file's content and the processor's settings (engine/media/towers.py): the second
turn must open no decoder and run no tower, give the very prompt the first preparation
gave, and reply as a fresh model does; a file rewritten under the same name is prepared
afresh. Tiny Qwen3-VL and Gemma 4 checkpoints (tests/golden), loaded in float32.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.api import GenerationParams, MediaInput, MemoryPlan
from engine.errors import MediaError
from engine.media.towers import DEFAULT_CACHE_BYTES, FEATURES_SHARE, ROOM_SHARE, MediaTowers, TowerSource
from engine.runtime.host import ModelHost

pytest.importorskip("av")

from tests.engine.media.clips import make_clip

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
QWEN = GOLDEN / "qwen3_vl" / "qwen3_vl"
GEMMA = GOLDEN / "gemma4_media"
PARAMS = GenerationParams(max_tokens=3, ignore_eos=True)


def load_float32(path: Path, budget: int | None = None) -> ModelHost:
    from engine.runtime import loading as loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        host = ModelHost()
        host.load(str(path), budget)
    return host


def first_turn(path: Path, kind: str) -> list[dict]:
    return json.loads((path / "expected.json").read_text())[kind]["messages"]


def follow_up(messages: list[dict], reply: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And after that?"}]


@pytest.fixture
def opens(monkeypatch) -> list[str]:
    """The video files opened for reading (probe and decoding both open through _open)."""
    from engine.media import video

    seen: list[str] = []
    real = video._open

    def counted(source):
        seen.append(str(source))
        return real(source)

    monkeypatch.setattr(video, "_open", counted)
    return seen


@pytest.fixture
def clip(tmp_path, shared_data) -> Path:
    return make_clip(tmp_path / "clip.mov", shared_data / "images")


@pytest.fixture
def hashed(monkeypatch) -> Callable[[bytes], int]:
    """How many sha256 hashers were fed a file's bytes (each is one read of it for hashing):
    hashlib.sha256 wrapped with a recorder, the hashing itself unchanged."""
    import hashlib

    fed: list[bytearray] = []
    real = hashlib.sha256

    class Recorded:
        def __init__(self, data: bytes = b"", **kwargs):
            self._hash = real(data, **kwargs)
            self._seen = bytearray(data)
            fed.append(self._seen)

        def update(self, data) -> None:
            self._seen += data
            self._hash.update(data)

        def __getattr__(self, name: str):  # digest, hexdigest, copy, name...
            return getattr(self._hash, name)

    monkeypatch.setattr(hashlib, "sha256", Recorded)
    return lambda data: sum(1 for seen in fed if seen.startswith(data))


@pytest.mark.parametrize("case", ["video", "both"])
def test_media_seen_for_the_first_time_is_hashed_once(case, clip, shared_data, hashed):
    """The prepared-items cache and the features cache key one file under different
    settings; both keys come from one read of its bytes."""
    host = load_float32(QWEN)
    photo = shared_data / "images" / "chelsea.png"
    media = [MediaInput("video", str(clip))]
    if case == "both":
        media.insert(0, MediaInput("image", str(photo)))
    host.generate("chat", first_turn(QWEN, case), PARAMS, media=media)
    assert host.towers.prepare_calls == len(media) and host.towers.encode_calls > 0
    assert hashed(clip.read_bytes()) == 1
    if case == "both":
        assert hashed(photo.read_bytes()) == 1


def test_a_request_stopped_before_its_prefill_encodes_nothing(clip):
    """Stop pressed before the prefill starts: the reply ends cancelled without the towers
    encoding the clip, and the chat's next request is a fresh model's."""
    import threading

    host = load_float32(QWEN)
    video = [MediaInput("video", str(clip))]
    first = first_turn(QWEN, "video")
    stopped = threading.Event()
    stopped.set()
    result = host.generate("chat", first, PARAMS, cancel=stopped, media=video)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert host.towers.encode_calls == 0
    again = host.generate("chat", first, PARAMS, media=video)
    assert host.towers.encode_calls > 0
    assert again.token_ids == load_float32(QWEN).generate("chat", first, PARAMS, media=video).token_ids


def test_a_follow_up_about_a_clip_opens_no_decoder_and_replies_as_a_fresh_model(clip, opens):
    host = load_float32(QWEN)
    video = [MediaInput("video", str(clip))]
    first = first_turn(QWEN, "video")
    reply = host.generate("chat", first, PARAMS, media=video)
    towers = host.towers
    assert opens and towers.prepare_calls == 1
    encodes = towers.encode_calls
    opens.clear()

    second = follow_up(first, reply.text)
    again = host.generate("chat", second, PARAMS, media=video)
    assert opens == []  # neither probed nor decoded
    assert towers.prepare_calls == 1 and towers.encode_calls == encodes
    assert again.stats.cached_tokens > 0  # the clip's tokens came from the KV cache as before

    fresh = load_float32(QWEN).generate("fresh", second, PARAMS, media=video)
    assert (again.token_ids, again.stats.prompt_tokens) == (fresh.token_ids, fresh.stats.prompt_tokens)


def test_a_remembered_clip_gives_the_first_preparations_prompt(clip, opens):
    host = load_float32(QWEN)
    chat = host.session("prompt")
    text = chat.render(first_turn(QWEN, "video"))
    video = [MediaInput("video", str(clip))]
    prepared = chat.media_prompt(text, video)
    features = [host.towers.features(span.item) for span in prepared.spans]
    opens.clear()

    remembered = chat.media_prompt(text, video)
    assert opens == []
    assert (remembered.ids, remembered.keys, remembered.notes) == (prepared.ids, prepared.keys, prepared.notes)
    for old, new, encoded in zip(prepared.spans, remembered.spans, features, strict=True):
        assert (new.start, new.end, new.item.key, new.item.grid) == (old.start, old.end, old.item.key, old.item.grid)
        assert new.item.data is None  # no pixels kept for it
        assert host.towers.features(new.item) is encoded
    assert host.towers.prepared.stats().bytes < 64 * 1024  # text and keys, not ~100 KB of patches


def test_a_rewritten_file_of_the_same_name_is_prepared_afresh(clip, shared_data, opens):
    host = load_float32(QWEN)
    chat = host.session("rewrite")
    text = chat.render(first_turn(QWEN, "video"))
    video = [MediaInput("video", str(clip))]
    before = chat.media_prompt(text, video)
    for span in before.spans:
        host.towers.features(span.item)
    make_clip(clip, shared_data / "images", reverse=True)  # same name, the frames backwards
    opens.clear()

    after = chat.media_prompt(text, video)
    assert opens and host.towers.prepare_calls == 2
    assert after.ids == before.ids  # the same size and length: the same placeholders...
    assert after.keys != before.keys  # ...standing for other content
    assert all(span.item.data is not None and span.item.encoded is None for span in after.spans)


def test_a_file_rewritten_while_a_request_reads_it_is_one_line(clip, shared_data):
    host = load_float32(QWEN)
    chat = host.session("race")
    text = chat.render(first_turn(QWEN, "video"))
    video = [MediaInput("video", str(clip))]
    for span in chat.media_prompt(text, video).spans:
        host.towers.features(span.item)
    host.towers.cache.clear()
    remembered = chat.media_prompt(text, video)  # known, but its features must be made again
    make_clip(clip, shared_data / "images", reverse=True)
    with pytest.raises(MediaError, match="changed while it was being read") as info:
        host.towers.features(remembered.spans[0].item)
    assert "\n" not in str(info.value)


def test_a_clip_whose_features_were_evicted_is_decoded_only_when_the_tower_must_run(clip, opens):
    """The features cache lost the clip (other media filled its budget): a follow-up in the
    same chat still needs nothing (the clip is in the KV cache's prefix); another chat
    prepares it afresh, once for all its frame groups, and replies as a fresh model does."""
    host = load_float32(QWEN)
    video = [MediaInput("video", str(clip))]
    first = first_turn(QWEN, "video")
    reply = host.generate("a", first, PARAMS, media=video)
    second = follow_up(first, reply.text)
    encodes = host.towers.encode_calls
    host.towers.cache.clear()
    opens.clear()

    host.generate("a", second, PARAMS, media=video)
    assert opens == [] and host.towers.prepare_calls == 1 and host.towers.encode_calls == encodes

    again = host.generate("b", second, PARAMS, media=video)  # a new chat: no KV to reuse
    assert opens and host.towers.prepare_calls == 2
    assert host.towers.encode_calls == 2 * encodes  # every frame group once more
    fresh = load_float32(QWEN).generate("fresh", second, PARAMS, media=video)
    assert again.token_ids == fresh.token_ids


def test_images_and_voice_notes_are_remembered_too(shared_data, monkeypatch):
    """Gemma 4: a photo and a voice note in one message; the follow-up decodes neither."""
    from engine.media import audio
    from engine.media.gemma4 import vision

    expected = json.loads((GEMMA / "expected.json").read_text())
    media = [
        MediaInput("image", str(shared_data / "images" / expected["image_file"])),
        MediaInput("audio", str(shared_data / "audio" / expected["audio_file"])),
    ]
    host = load_float32(GEMMA)
    first = expected["both"]["messages"]
    reply = host.generate("chat", first, PARAMS, media=media)
    loads: list[str] = []
    for module, name in ((vision, "load_image"), (audio, "load_audio_source")):

        def counted(source, *args, _real=getattr(module, name), **kwargs):
            loads.append(str(source))
            return _real(source, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    encodes = host.towers.encode_calls
    again = host.generate("chat", follow_up(first, reply.text), PARAMS, media=media)
    assert loads == [] and host.towers.prepare_calls == 2 and host.towers.encode_calls == encodes
    fresh = load_float32(GEMMA).generate("fresh", follow_up(first, reply.text), PARAMS, media=media)
    assert again.token_ids == fresh.token_ids


# ---- the features cache's budget follows the model (engine/media/towers.py) ----------------


def qwen3_vl_4b(folder: Path, plan: MemoryPlan | None) -> MediaTowers:
    """MediaTowers for Qwen3-VL-4B's published tower and processor settings (the bench's
    shapes). No weights: the budget is made from settings before any tower loads."""
    from engine.artifacts.config import config_from_dict
    from engine.cli.bench_media import IMAGE_SETTINGS, MEDIA_SHAPES, VIDEO_SETTINGS

    folder.mkdir()
    settings = {"image_processor": IMAGE_SETTINGS, "video_processor": VIDEO_SETTINGS}
    (folder / "processor_config.json").write_text(json.dumps(settings))
    shape = MEDIA_SHAPES["qwen3-vl-4b"]
    raw = {"model_type": shape["model_type"], "text_config": shape["text"], "vision_config": shape["vision"]}
    return MediaTowers(TowerSource("Qwen3-VL-4B", folder, config_from_dict(raw), None, "bfloat16"), plan=plan)


def budget(plan_bytes: float, weights: float) -> MemoryPlan:
    return MemoryPlan(int(weights), 0, int(plan_bytes), int(plan_bytes))


@dataclass
class Features:
    """A stand-in for a tower's output of ``nbytes`` (the cache counts its bytes only)."""

    nbytes: int


WIDTH = 2560 * 4 * 2  # bytes a token: 2,560 wide for the merger and its 3 DeepStack layers, bfloat16


def clip_feature_bytes(towers: MediaTowers, seconds: int, width: int, height: int) -> int:
    """A clip's features at Qwen3-VL-4B's settings, as its video processor sizes the frames
    (2 frames a second, a temporal patch of 2 frames per group of tokens)."""
    frames = seconds * 2
    h, w = towers.encoder("video").processor.frame_size(frames, height, width)
    return frames // 2 * (h // 16) * (w // 16) // 4 * WIDTH


def photo_feature_bytes(towers: MediaTowers, width: int, height: int) -> int:
    h, w = towers.encoder("image").processor.target_size(height, width)
    return (h // 32) * (w // 32) * WIDTH


def test_two_clips_and_a_photo_stay_cached_at_qwen3_vl_4b_size(tmp_path):
    """At Qwen3-VL-4B's size a 30 s 720p clip's features are ~240 MB (near the most a clip
    can give: the processor's pixel budget) and a 4K photo's ~166 MB: under the fixed
    512 MiB two clips filled the cache and a photo beside them evicted one."""
    towers = qwen3_vl_4b(tmp_path / "4b", budget(16e9, 2.5e9))  # 4-bit weights on a 16 GB budget
    clip = clip_feature_bytes(towers, 30, 1280, 720)
    photo = photo_feature_bytes(towers, 3840, 2160)
    assert 230e6 < clip < 260e6 and 150e6 < photo < 180e6
    assert 2 * clip + photo > DEFAULT_CACHE_BYTES
    assert towers.cache.stats().max_bytes >= 2 * towers.encoder("video").max_feature_bytes() + photo
    for key, size in (("first clip", clip), ("second clip", clip), ("photo", photo)):
        towers.cache.put(key, Features(size))
    assert all(key in towers.cache for key in ("first clip", "second clip", "photo"))
    assert towers.cache.stats().evictions == 0


def test_the_features_budget_shrinks_with_a_small_memory_budget(tmp_path):
    roomy = qwen3_vl_4b(tmp_path / "roomy", budget(16e9, 2.5e9)).cache.stats().max_bytes
    small = qwen3_vl_4b(tmp_path / "small", budget(4e9, 3e9)).cache.stats().max_bytes
    assert small <= ROOM_SHARE * 1e9  # most of the 1 GB beside the weights stays the KV cache's
    tiny = qwen3_vl_4b(tmp_path / "tiny", budget(1e9, 0.1e9)).cache.stats().max_bytes
    assert tiny <= FEATURES_SHARE * 1e9
    assert roomy > small > 0 and roomy > tiny > 0
    unbounded = qwen3_vl_4b(tmp_path / "unbounded", None).cache.stats().max_bytes  # no plan: the items' room
    assert unbounded >= roomy


def test_the_features_estimate_is_the_towers_real_output_and_the_load_bounds_it(clip, shared_data):
    """The tiny Qwen3-VL: its tower's real output per token is what the estimate counts
    (out_hidden, once per DeepStack layer too, float32 here), no item exceeds the estimated
    largest, and a load under a small memory budget gets a smaller features cache."""
    small = 500_000_000
    host = load_float32(QWEN, budget=small)
    towers = host.towers
    for item in (MediaInput("video", str(clip)), MediaInput("image", str(shared_data / "images" / "chelsea.png"))):
        encoder = towers.encoder(item.kind)
        prepared = towers.prepare([item])[0]
        assert 0 < prepared.n_tokens <= encoder.max_tokens()
        run = prepared.runs()[0]
        assert towers.features(run).nbytes == run.n_tokens * encoder.max_feature_bytes() // encoder.max_tokens()
    assert towers.largest_item_bytes() == max(towers.encoder(k).max_feature_bytes() for k in ("image", "video"))
    assert towers.cache.stats().max_bytes <= FEATURES_SHARE * small < DEFAULT_CACHE_BYTES
