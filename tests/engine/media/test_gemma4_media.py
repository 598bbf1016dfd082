"""Gemma 4 sees and hears: images, audio and both in one message against transformers 5.23
(tests/golden/make_gemma4_media_goldens.py).

The tiny checkpoint is bf16 on disk and loaded in float32, as the references ran. The
photo is ../shared/data/images/chelsea.png, the clip ../shared/data/audio/jfk.wav.
Compared: the image processor's patches (bit for bit), positions and soft-token count;
the audio features (bit for bit) and valid-frame mask; both towers' outputs in the
language model's width; the expanded prompts; greedy ids with log-probabilities.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput
from engine.errors import MediaError
from engine.media.audio import load_audio_source
from engine.media.gemma4.processor import Gemma4AudioFeatures, Gemma4ImageProcessor, audio_soft_tokens
from engine.media.image import load_image
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

FOLDER = Path(__file__).resolve().parents[2] / "golden" / "gemma4_media"
EXPECTED = json.loads((FOLDER / "expected.json").read_text())
PROCESSOR = json.loads((FOLDER / "processor_config.json").read_text())
LONG = json.loads((FOLDER / "long_audio.json").read_text())  # make_gemma4_long_audio_goldens.py


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()).hexdigest()


def load_float32(path: Path) -> ModelHost:
    from engine.runtime import loading as loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        host = ModelHost()
        host.load(str(path))
    return host


@pytest.fixture(scope="module")
def host() -> ModelHost:
    return load_float32(FOLDER)


def media_for(case: str, shared_data: Path) -> list[MediaInput]:
    image = MediaInput("image", str(shared_data / "images" / EXPECTED["image_file"]))
    audio = MediaInput("audio", str(shared_data / "audio" / EXPECTED["audio_file"]))
    return {"image": [image], "audio": [audio], "both": [image, audio]}[case]


def test_image_patches_positions_and_soft_tokens_match_transformers(shared_data):
    processor = Gemma4ImageProcessor.from_config(PROCESSOR["image_processor"])
    vision = processor(load_image(shared_data / "images" / EXPECTED["image_file"]))
    assert vision.soft_tokens == EXPECTED["image_soft_tokens"]
    assert list(vision.patches.shape) == EXPECTED["image_pixels"]["shape"]
    assert sha(vision.patches) == EXPECTED["image_pixels"]["sha256"]
    assert vision.positions.tolist() == EXPECTED["image_positions"]


def test_audio_features_and_mask_match_transformers(shared_data):
    features = Gemma4AudioFeatures.from_config(PROCESSOR["feature_extractor"])
    mel, mask = features(load_audio_source(shared_data / "audio" / EXPECTED["audio_file"], 16000))
    want = EXPECTED["audio_features"]
    assert list(mel.shape) == want["shape"]
    np.testing.assert_allclose(mel[::50], np.array(want["every_50th"]), atol=1e-5, rtol=0)
    assert sha(mel) == want["sha256"]
    assert [int(mask.sum()), len(mask)] == EXPECTED["audio_mask"]
    assert audio_soft_tokens(mask) == EXPECTED["audio_tokens"]


def test_text_only_chat_never_reads_tower_weights(monkeypatch):
    from engine.media import towers

    def refuse(*_a, **_k):
        raise AssertionError("a text-only chat read tower weights")

    monkeypatch.setattr(towers, "load_tower_weights", refuse)
    h = ModelHost()
    h.load(str(FOLDER))
    assert h.info.vision and h.info.audio and h.towers.kinds == {"image", "audio"}
    result = h.generate("t", [{"role": "user", "content": "describe it"}], GenerationParams(max_tokens=3))
    assert len(result.token_ids) == 3
    assert not h.tower_loaded and h.towers.encode_calls == 0


@pytest.mark.parametrize("case", ["image", "audio", "both"])
def test_prompts_and_tower_outputs_match_transformers(host, shared_data, case):
    exp = EXPECTED[case]
    chat = host.session(f"prompt-{case}")
    messages, items = split_media(exp["messages"], media_for(case, shared_data))
    prompt = chat.media_prompt(chat.render(messages), items)
    assert prompt.ids == exp["prompt_ids"]
    assert [s.item.kind for s in prompt.spans] == [m.kind for m in items]  # in the order given
    for span in prompt.spans:
        features = np.array(host.towers.features(span.item))
        if span.item.kind == "image":
            np.testing.assert_allclose(features, np.array(EXPECTED["image_features"]), atol=1e-4, rtol=0)
        else:
            assert features.shape[0] == EXPECTED["audio_tokens"]
            np.testing.assert_allclose(features[:16], np.array(EXPECTED["audio_rows"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [512, 7])
@pytest.mark.parametrize("case", ["image", "audio", "both"])
def test_greedy_ids_and_logprobs_match_transformers(host, shared_data, case, chunk):
    """A chunk of 7 ends inside the image's run of soft tokens; the prefill moves it off."""
    exp = EXPECTED[case]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk)
    result = host.generate(f"{case}{chunk}", exp["messages"], params, media=media_for(case, shared_data))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])


def test_an_mlx_layout_loads_the_towers_too(tmp_path, shared_data):
    """mlx-vlm's names (no ``model.`` before the towers) and channels-last conv kernels."""
    import mlx.core as mx

    folder = tmp_path / "mlx"
    shutil.copytree(FOLDER, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    out = {}
    for name, value in weights.items():
        if name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_")):
            name = name.removeprefix("model.")
            if name.endswith("conv.weight") and value.ndim == 4:
                value = value.transpose(0, 2, 3, 1)
            elif name.endswith("depthwise_conv1d.weight"):
                value = value.transpose(0, 2, 1)
        out[name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), out, metadata={"format": "mlx"})
    h = load_float32(folder)
    exp = EXPECTED["both"]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), ignore_eos=True)
    result = h.generate("mlx", exp["messages"], params, media=media_for("both", shared_data))
    assert result.token_ids == exp["token_ids"]


@pytest.fixture
def long_clip(shared_data, tmp_path) -> Path:
    """jfk.wav four times over (44 s), as make_gemma4_long_audio_goldens.py builds it."""
    import wave

    with wave.open(str(shared_data / "audio" / LONG["audio_file"])) as w:
        params, frames = w.getparams(), w.readframes(w.getnframes())
    path = tmp_path / "jfk_44s.wav"
    with wave.open(str(path), "wb") as out:
        out.setparams(params)
        out.writeframes(frames * LONG["repeats"])
    return path


def test_audio_over_30_s_is_cut_as_transformers_cuts_it(long_clip):
    """Gemma4AudioFeatureExtractor keeps the first 480,000 samples (30 s) by default."""
    features = Gemma4AudioFeatures.from_config(PROCESSOR["feature_extractor"])
    samples = load_audio_source(long_clip, 16000)
    assert len(samples) / 16000 == LONG["seconds"] > 30
    mel, mask = features(samples)
    want = LONG["audio_features"]
    assert list(mel.shape) == want["shape"]
    np.testing.assert_allclose(mel[::50], np.array(want["every_50th"]), atol=1e-5, rtol=0)
    assert sha(mel) == want["sha256"]
    assert [int(mask.sum()), len(mask)] == LONG["audio_mask"]
    assert "of 44 s is longer than Gemma 4 hears: only its first 30 s" in features.cut_note(len(samples))
    assert features.cut_note(30 * 16000) == ""


def test_a_long_clip_answers_as_transformers_and_says_it_was_cut(host, long_clip, shared_data):
    params = GenerationParams(max_tokens=len(LONG["token_ids"]), logprobs=True, ignore_eos=True)
    result = host.generate("long", LONG["messages"], params, media=[MediaInput("audio", str(long_clip))])
    assert result.stats.prompt_tokens == len(LONG["prompt_ids"])
    assert result.token_ids == LONG["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, LONG["token_logprobs"], atol=1e-3, rtol=0)
    assert result.notes == [
        "An audio clip of 44 s is longer than Gemma 4 hears: only its first 30 s were heard "
        "(cut it into parts, or transcribe it, for the rest)."
    ]
    short = host.generate(
        "short", EXPECTED["audio"]["messages"], GenerationParams(max_tokens=1), media=media_for("audio", shared_data)
    )
    assert short.notes == []  # an 11 s clip is heard whole


def test_an_empty_clip_and_a_bad_budget_get_one_line():
    features = Gemma4AudioFeatures()
    with pytest.raises(MediaError, match="empty"):
        features(np.zeros(0, np.float32))
    with pytest.raises(MediaError, match="max_soft_tokens"):
        Gemma4ImageProcessor.from_config({"max_soft_tokens": 100})


def test_a_flat_rope_theta_in_vision_config_reads_the_same(tmp_path, shared_data):
    folder = tmp_path / "flat"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    vision["rope_theta"] = vision.pop("rope_parameters")["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    h = load_float32(folder)
    exp = EXPECTED["image"]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True)
    result = h.generate("flat", exp["messages"], params, media=media_for("image", shared_data))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
