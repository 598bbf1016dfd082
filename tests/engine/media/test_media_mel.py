"""Whisper log-mel features against transformers' WhisperFeatureExtractor.

The reference (tests/golden/media/whisper_features.npz, from
tests/golden/make_media_goldens.py) is transformers' extractor run on
../shared/data/audio/jfk.wav with 80 and 128 mel bins: its filter bank in full, every
5th frame of the features, and totals over all 3000 frames.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.media.audio import load_audio, log_mel_spectrogram
from engine.media.mel import hz_to_mel, mel_filters, mel_to_hz, power_spectrogram

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"
# transformers computes the STFT in float32 with torch; ours runs in float64.
FEATURE_ATOL = 1e-4


@pytest.fixture(scope="module")
def gold() -> dict:
    with np.load(GOLDEN / "whisper_features.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def jfk(shared_data) -> np.ndarray:
    return load_audio(shared_data / "audio" / "jfk.wav", 16000)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_slaney_filter_bank_matches_transformers(gold, n_mels):
    ref = gold[f"mel{n_mels}/filters"]
    ours = mel_filters(n_mels, n_fft=400, sample_rate=16000)
    assert ours.shape == ref.shape == (201, n_mels)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_of_jfk_matches_whisper_feature_extractor(gold, jfk, n_mels):
    ours = log_mel_spectrogram(jfk, n_mels=n_mels)
    key = f"mel{n_mels}"
    assert ours.shape == tuple(gold[f"{key}/shape"]) == (n_mels, 3000)
    assert ours.dtype == np.float32
    stride = json.loads((GOLDEN / "versions.json").read_text())["mel_frame_stride"]
    np.testing.assert_allclose(ours[:, ::stride], gold[f"{key}/frames"], rtol=0, atol=FEATURE_ATOL)
    o = ours.astype(np.float64)
    total, abs_total, energy, lo, hi = gold[f"{key}/stats"]
    np.testing.assert_allclose([o.sum(), np.abs(o).sum(), (o**2).sum()], [total, abs_total, energy], rtol=1e-5)
    np.testing.assert_allclose([o.min(), o.max()], [lo, hi], atol=FEATURE_ATOL)


def test_mel_scale_round_trip_and_knee():
    hz = np.array([0.0, 500.0, 1000.0, 4000.0, 8000.0])
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(hz_to_mel(1000.0), 15.0)  # the linear/log knee of Slaney's scale
    np.testing.assert_allclose(hz_to_mel(200.0), 3.0)


def test_power_spectrogram_of_a_bin_centred_tone():
    """A cosine on FFT bin k puts (A * sum(window) / 2)^2 into bin k of interior frames."""
    n_fft, k = 400, 25
    x = np.cos(2 * np.pi * k * np.arange(16000) / n_fft)
    power = power_spectrogram(x, n_fft, 160)
    assert power.shape == (201, 1 + 16000 // 160)
    mid = power[:, 50]
    assert int(np.argmax(mid)) == k
    np.testing.assert_allclose(mid[k], (n_fft / 2 / 2) ** 2, rtol=1e-9)  # periodic Hann sums to n/2


def test_padding_truncation_and_unpadded_mode(jfk):
    long = np.concatenate([jfk, jfk, jfk])  # 33 s: cut to 30 s
    assert log_mel_spectrogram(long).shape == (80, 3000)
    np.testing.assert_array_equal(log_mel_spectrogram(long[:480000]), log_mel_spectrogram(long))
    assert log_mel_spectrogram(jfk, chunk_seconds=None).shape == (80, 176000 // 160)


def test_log_mel_rejects_non_mono():
    with pytest.raises(ValueError, match="mono"):
        log_mel_spectrogram(np.zeros((2, 16000), dtype=np.float32))
