"""Whisper-style log-mel spectrogram in numpy.

The recipe Whisper's encoders (and Qwen2-Audio / Voxtral, which reuse them) were trained
on: pad or cut to 30 s, centred STFT with reflect padding and a periodic Hann window,
power spectrum without its last frame, Slaney-normalised mel filters on the Slaney mel
scale, log10 floored at 1e-10, dynamic range limited to 8 (i.e. 80 dB) below the peak,
then scaled as (x + 4) / 4.
"""

from __future__ import annotations

import numpy as np

WHISPER_SAMPLE_RATE = 16000
WHISPER_CHUNK_SECONDS = 30
WHISPER_HOP_LENGTH = 160  # samples per feature frame (10 ms)

# Slaney's mel scale: linear up to 1 kHz (3 mels per 200 Hz), logarithmic above.
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = np.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _F_SP
    log = _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return np.where(hz >= _MIN_LOG_HZ, log, linear)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _F_SP
    log = _MIN_LOG_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(mel >= _MIN_LOG_MEL, log, linear)


def mel_filters(
    n_mels: int,
    n_fft: int = 400,
    sample_rate: int = WHISPER_SAMPLE_RATE,
    f_min: float = 0.0,
    f_max: float | None = None,
) -> np.ndarray:
    """Triangular Slaney-normalised filters, shape (n_fft // 2 + 1, n_mels)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    fft_hz = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    widths = np.diff(edges_hz)
    offsets = edges_hz[None, :] - fft_hz[:, None]  # (bins, n_mels + 2)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    # Slaney normalisation: every filter has unit area in Hz.
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


def _hann_periodic(n: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def power_spectrogram(audio: np.ndarray, n_fft: int = 400, hop_length: int = WHISPER_HOP_LENGTH) -> np.ndarray:
    """|STFT|^2 of a centred, reflect-padded signal, shape (n_fft // 2 + 1, frames)."""
    x = np.asarray(audio, dtype=np.float64)
    if x.shape[0] <= n_fft // 2:
        raise ValueError(f"audio needs more than {n_fft // 2} samples for a centred STFT")
    x = np.pad(x, n_fft // 2, mode="reflect")
    n_frames = 1 + (x.shape[0] - n_fft) // hop_length
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop_length][:n_frames]
    spectrum = np.fft.rfft(frames * _hann_periodic(n_fft), axis=-1)
    return (spectrum.real**2 + spectrum.imag**2).T


def log_mel_spectrogram(
    audio: np.ndarray,
    n_mels: int = 80,
    n_fft: int = 400,
    hop_length: int = WHISPER_HOP_LENGTH,
    sample_rate: int = WHISPER_SAMPLE_RATE,
    chunk_seconds: float | None = WHISPER_CHUNK_SECONDS,
) -> np.ndarray:
    """Whisper's input features for mono ``audio`` at ``sample_rate``: float32 (n_mels, frames).

    With ``chunk_seconds`` (default 30) the audio is zero-padded or cut to that length
    first, giving 3000 frames at the defaults; ``None`` keeps its own length.
    """
    x = np.asarray(audio, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"log_mel_spectrogram takes mono audio (1-D), got shape {x.shape}")
    if chunk_seconds is not None:
        n_samples = int(round(chunk_seconds * sample_rate))
        x = np.pad(x[:n_samples], (0, max(0, n_samples - x.shape[0])))
    power = power_spectrogram(x, n_fft, hop_length)[:, :-1]
    mel = mel_filters(n_mels, n_fft, sample_rate).T @ power
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)
