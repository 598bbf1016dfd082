"""Qwen2-Audio against transformers' Qwen2AudioForConditionalGeneration.

tests/golden/make_audio_goldens.py builds a tiny random Qwen2-Audio (128 mels as the
real one, audio d_model 48, text hidden 64, 2+2 layers, a 160-word vocabulary with
<|AUDIO|>), runs the real Qwen2AudioProcessor on a chat with the first 4 s of
../shared/data/audio/jfk.wav, and stores the features, the expanded prompt ids, the
projected audio features, and greedy ids with their log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.media.audio import load_audio
from engine.media.qwen2_audio.tower import audio_token_count, feature_frames, tower_for
from engine.runtime.loading import load_model
from engine.runtime.model_info import inspect_model
from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from tests.engine.media.audio_checkpoints import load_arrays, load_meta, write_qwen2_audio_folder

META = load_meta("qwen2_audio_tiny")
AUDIO_ID = META["config"]["audio_token_index"]


@pytest.fixture(scope="module")
def gold() -> dict:
    return load_arrays("qwen2_audio_tiny")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_qwen2_audio_folder(tmp_path_factory.mktemp("qa") / "tiny-qwen2-audio")


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(folder)


@pytest.fixture(scope="module")
def tower(loaded, folder):
    return tower_for(loaded.model, folder)


@pytest.fixture(scope="module")
def clip(shared_data) -> np.ndarray:
    return load_audio(shared_data / "audio" / "jfk.wav")[: int(META["audio_seconds"] * 16000)]


def test_features_and_frame_count_match_the_processor(tower, clip, gold):
    feats, frames = tower.features(clip)
    assert feats.shape == (128, 3000)
    assert frames == int(gold["features/mask"].sum()) == 400
    np.testing.assert_allclose(feats[:, :: META["stride"]], gold["features/frames"], atol=1e-4, rtol=0)


def test_projected_audio_features_match(tower, clip, gold):
    projected = np.array(tower.embed_audio(clip))
    assert projected.shape == gold["projected"].shape == (META["audio_tokens"], 64)
    np.testing.assert_allclose(projected, gold["projected"], atol=1e-4, rtol=0)


def test_placeholder_count_follows_the_processor_formula():
    # (((frames - 1) // 2 + 1) - 2) // 2 + 1, with 30 s (3000 frames) at most.
    assert [audio_token_count(f) for f in (1, 2, 3, 4, 5, 400, 3000)] == [0, 0, 1, 1, 1, 100, 750]
    assert feature_frames(64000) == 400 and feature_frames(64001) == 401 and feature_frames(10**7) == 3000


def test_a_clip_too_short_for_one_token_is_refused(tower):
    from engine.errors import MediaError

    with pytest.raises(MediaError, match="too short"):
        tower.features(np.zeros(300, np.float32))


def test_prompt_expansion_matches_the_processor(folder, gold):
    tok = Tokenizer.from_dir(folder)
    text = ChatTemplate(tok.chat_template).render(META["messages"], add_generation_prompt=True)
    assert text == META["prompt_text"]
    ids = tok.encode(text.replace("<|AUDIO|>", "<|AUDIO|>" * META["audio_tokens"]), add_special_tokens=False)
    assert ids == gold["prompt/ids"].tolist()


def test_greedy_ids_and_logprobs_with_spliced_audio(loaded, tower, clip, gold):
    """The language model fed the prompt's embeddings with the audio spliced in."""
    model = loaded.model
    ids = gold["prompt/ids"].tolist()
    x = mx.array([ids])
    at = mx.array(np.array(ids) == AUDIO_ID)[None, :, None]
    audio = tower.embed_audio(clip)
    start = ids.index(AUDIO_ID)
    spread = mx.concatenate([mx.zeros((start, 64)), audio, mx.zeros((len(ids) - start - audio.shape[0], 64))])
    embeddings = mx.where(at, spread[None], model.embed(x))
    cache = model.make_cache()
    logits = model(x, cache, input_embeddings=embeddings)[0, -1]
    np.testing.assert_allclose(np.array(logits), gold["prompt/last_logits"], atol=1e-4)
    out, logprobs = [], []
    for _ in range(META["steps"]):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logprobs.append(float((logits - mx.logsumexp(logits))[t]))
        logits = model(mx.array([[t]]), cache)[0, -1]
    assert out == gold["greedy/ids"].tolist()
    np.testing.assert_allclose(logprobs, gold["greedy/logprobs"], atol=2e-3)


def test_both_weight_spellings_load_and_the_config_says_audio(tmp_path, clip, gold):
    """transformers 5 saves model.language_model.* / model.audio_tower.*; the Hub has the older names."""
    folder = write_qwen2_audio_folder(tmp_path / "v5", hub_names=False)
    loaded = load_model(folder)
    projected = np.array(tower_for(loaded.model, folder).embed_audio(clip))
    np.testing.assert_allclose(projected, gold["projected"], atol=1e-4, rtol=0)
    info = inspect_model(folder)
    assert info.family == "qwen2_audio" and info.audio and not info.vision


def test_tower_weights_stay_out_of_the_language_model(loaded):
    from mlx.utils import tree_flatten

    names = [n for n, _ in tree_flatten(loaded.model.parameters())]
    assert names and not [n for n in names if "audio" in n or "projector" in n or "conv" in n]
    assert loaded.model.args.audio_token_index == AUDIO_ID
