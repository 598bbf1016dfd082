"""Whisper in MLX against transformers' WhisperForConditionalGeneration.

tests/golden/make_media_goldens.py builds a tiny random Whisper (d_model 64, 2+2 layers,
vocab 100) whose weights come from ``synthetic_weight`` (a seeded generator keyed by
parameter name, repeated below), runs it on the log-mel features of
../shared/data/audio/jfk.wav, and stores the encoder output and a plain greedy decode
(each step recomputed without a cache) with its logits at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from golden.synthetic_weights import synthetic_weight

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.media.audio import load_audio, log_mel_spectrogram
from engine.media.whisper.model import Whisper, WhisperConfig

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"
META = json.loads((GOLDEN / "whisper_tiny.json").read_text())


def hf_weights() -> dict[str, np.ndarray]:
    weights = {name: synthetic_weight(name, tuple(shape)) for name, shape in META["parameters"].items()}
    weights["proj_out.weight"] = weights["model.decoder.embed_tokens.weight"]  # as a tied checkpoint saves it
    return weights


@pytest.fixture(scope="module")
def gold() -> dict:
    with np.load(GOLDEN / "whisper_tiny.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def model() -> Whisper:
    m = Whisper(WhisperConfig.from_dict(META["config"]))
    m.load_hf_weights(hf_weights())
    return m


@pytest.fixture(scope="module")
def features(shared_data) -> np.ndarray:
    return log_mel_spectrogram(load_audio(shared_data / "audio" / "jfk.wav"), n_mels=80)


@pytest.fixture(scope="module")
def encoded(model, features) -> mx.array:
    return model.encode(features)


def test_encoder_matches_transformers(encoded, gold):
    encoded = np.array(encoded[0])
    assert encoded.shape == tuple(gold["encoder/shape"]) == (1500, 64)
    stride = META["encoder_stride"]
    # Measured: ~1e-6 (the inputs differ by ~1e-5: our STFT vs transformers' torch one).
    np.testing.assert_allclose(encoded.reshape(-1)[::stride], gold["encoder/strided"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(encoded.astype(np.float64).mean(axis=1), gold["encoder/position_means"], atol=2e-6)


def test_greedy_decoding_matches_transformers(model, features, gold):
    ids = model.greedy_decode(features, META["prompt"], max_new_tokens=META["steps"])
    assert ids == gold["greedy/ids"].tolist()


def test_cached_step_logits_match_uncached_reference(model, encoded, gold):
    """Every step's logits from the KV-cached loop equal transformers' full recomputation."""
    cache = model.make_cache()
    ids = mx.array([META["prompt"]], dtype=mx.int32)
    for step, expected in enumerate(gold["greedy/logits"]):
        logits = np.array(model.logits(ids, encoded, cache)[0, -1])
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0, err_msg=f"step {step}")
        ids = mx.array([[int(gold["greedy/ids"][step])]], dtype=mx.int32)


def test_eos_stops_decoding(model, encoded, gold):
    first = int(gold["greedy/ids"][0])
    assert model.decode_greedy(encoded, META["prompt"], max_new_tokens=10, eos_token_id=first) == [first]


def test_prompt_fed_token_by_token_equals_prompt_at_once(model, encoded):
    """Prefilling several tokens after a cached prefix uses a bottom-right causal mask."""
    prompt = META["prompt"] + [5, 9, 13]
    whole = np.array(model.logits(mx.array([prompt]), encoded, model.make_cache())[0])
    cache = model.make_cache()
    head = np.array(model.logits(mx.array([prompt[:2]]), encoded, cache)[0])
    tail = np.array(model.logits(mx.array([prompt[2:]]), encoded, cache)[0])
    np.testing.assert_allclose(np.concatenate([head, tail]), whole, atol=1e-4)


def test_bad_weights_and_configs_are_reported():
    cfg = WhisperConfig.from_dict({**META["config"], "unknown_key": 1})
    weights = hf_weights()
    del weights["model.decoder.layer_norm.bias"]
    with pytest.raises(ModelLoadError, match="do not fit"):
        Whisper(cfg).load_hf_weights(weights)
    weights = hf_weights()
    weights["model.encoder.conv1.weight"] = weights["model.encoder.conv1.weight"][:, :40]
    with pytest.raises(ModelLoadError, match="conv1"):
        Whisper(cfg).load_hf_weights(weights)
    with pytest.raises(UnsupportedModelError, match="activation"):
        WhisperConfig.from_dict({**META["config"], "activation_function": "relu"})
