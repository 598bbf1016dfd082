"""Reading audio files into mono float32 at the rate a model expects.

WAV is read without outside help (PCM through the standard ``wave`` module, IEEE
float through a small RIFF chunk walk, since ``wave`` refuses it). Compressed formats
(MP3, FLAC, OGG, M4A, ...) go through an ``ffmpeg`` executable when one is on PATH.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import MediaError
from engine.files import WAV_FILE_LIMIT, read_bytes_bounded
from engine.media.mel import log_mel_spectrogram  # noqa: F401  (part of this module's API)
from engine.media.resample import resample

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE
_FFMPEG_TIMEOUT_S = 300


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32, shape (frames, channels), nominally in [-1, 1]
    sample_rate: int


def sniff_audio_format(head: bytes, suffix: str = "") -> str:
    """A short name for the container, from its first bytes (the suffix only breaks ties)."""
    if head[:4] in (b"RIFF", b"RIFX") and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "OGG"
    if head[4:8] == b"ftyp":
        return "M4A"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "MP3"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF"
    if head[:4] == b"\x1aE\xdf\xa3":
        return "WEBM"
    return suffix.lstrip(".").upper() or "unknown"


def load_audio(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    """Decode ``path`` to mono float32 samples at ``sample_rate`` Hz.

    Channels are averaged; other rates are converted with a band-limited resampler.
    Raises MediaError, naming the file and the reason, when it cannot be decoded.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        raise MediaError(f"Audio file not found: {path}") from None
    except OSError as e:
        raise MediaError(f"Cannot read audio file {path}: {e.strerror or e}") from None
    if not head:
        raise MediaError(f"Audio file {path.name} is empty (0 bytes).")

    kind = sniff_audio_format(head, path.suffix)
    if kind == "WAV":
        decoded = _read_wav(path)
        mono = decoded.samples.mean(axis=1, dtype=np.float64).astype(np.float32)
        if decoded.sample_rate != sample_rate:
            mono = resample(mono, decoded.sample_rate, sample_rate)
        return mono
    return _decode_with_ffmpeg(path, kind, sample_rate)


def load_audio_source(source: str | Path | bytes, sample_rate: int = 16000) -> np.ndarray:
    """``load_audio`` for a path or a file's encoded bytes (a recording held in memory)."""
    if not isinstance(source, (bytes, bytearray, memoryview)):
        return load_audio(source, sample_rate)
    import tempfile

    # The decoders (ffmpeg among them) read files; the format is sniffed from the bytes.
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip"
        path.write_bytes(bytes(source))
        return load_audio(path, sample_rate)


# ---- WAV --------------------------------------------------------------------------


def _read_wav(path: Path) -> DecodedAudio:
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
        return _finish_wav(path, _pcm_to_float(raw, width, channels), rate)
    except wave.Error as e:
        if "unknown format: 3" in str(e) or "unknown format: 65534" in str(e):
            return _read_float_wav(path)  # ``wave`` only does integer PCM
        raise MediaError(f"Audio file {path.name} is not a readable WAV file: {e}.") from None
    except EOFError:
        raise MediaError(f"Audio file {path.name} is truncated: its WAV header is incomplete.") from None
    except (RuntimeError, ValueError, OverflowError):  # ``wave`` trips over chunk sizes past the end
        raise MediaError(f"Audio file {path.name} is not a readable WAV file: a chunk runs past its end.") from None


def _pcm_to_float(raw: bytes, width: int, channels: int) -> np.ndarray:
    frame_bytes = width * channels
    raw = raw[: len(raw) - len(raw) % frame_bytes]  # a torn last frame is dropped
    if width == 1:  # 8-bit WAV is unsigned with 128 as silence
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    else:
        raise MediaError(f"WAV sample width of {width * 8} bits is not supported; use 8, 16, 24 or 32.")
    return x.reshape(-1, channels)


def _read_float_wav(path: Path) -> DecodedAudio:
    data = read_bytes_bounded(path, WAV_FILE_LIMIT, "a WAV file", MediaError)
    fmt, payload = None, None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            payload = body
            break
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or len(fmt) < 16 or payload is None:
        raise MediaError(f"Audio file {path.name} is not a readable WAV file: no fmt or data chunk.")
    tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # first two bytes of the SubFormat GUID
    if channels == 0 or rate == 0:
        raise MediaError(f"Audio file {path.name} has a broken WAV header (0 channels or 0 Hz).")
    if tag == _WAVE_FORMAT_PCM:
        return _finish_wav(path, _pcm_to_float(payload, bits // 8, channels), rate)
    if tag != _WAVE_FORMAT_IEEE_FLOAT or bits not in (32, 64):
        raise MediaError(
            f"Audio file {path.name} uses WAV encoding {tag} ({bits}-bit), which is not supported; "
            "convert it to 16-bit PCM WAV."
        )
    dtype = "<f4" if bits == 32 else "<f8"
    frame_bytes = bits // 8 * channels
    payload = payload[: len(payload) - len(payload) % frame_bytes]
    x = np.frombuffer(payload, dtype).astype(np.float32).reshape(-1, channels)
    return _finish_wav(path, x, rate)


# Sample rates a recording can have; a header outside claims hours for seconds of sound.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 2_000, 768_000


def _finish_wav(path: Path, samples: np.ndarray, rate: int) -> DecodedAudio:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise MediaError(
            f"Audio file {path.name} claims a sample rate of {rate:,} Hz (recordings use "
            f"{MIN_SAMPLE_RATE:,}-{MAX_SAMPLE_RATE:,}): its header is damaged; convert or re-record it."
        )
    if samples.shape[0] == 0:
        raise MediaError(f"Audio file {path.name} contains no audio samples.")
    if not np.all(np.isfinite(samples)):
        raise MediaError(f"Audio file {path.name} contains invalid (NaN or infinite) samples.")
    return DecodedAudio(samples=samples, sample_rate=rate)


# ---- everything else: ffmpeg ------------------------------------------------------


def _decode_with_ffmpeg(path: Path, kind: str, sample_rate: int) -> np.ndarray:
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        raise MediaError(
            f"Cannot decode {kind} audio ({path.name}) without ffmpeg: install ffmpeg "
            "(e.g. `brew install ffmpeg`) or convert the file to WAV."
        )
    cmd = [
        ffmpeg,
        "-nostdin",
        "-v",
        "error",
        "-i",
        str(path),
        "-vn",
        "-map",
        "0:a:0",
        "-ac",
        "1",
        "-ar",
        str(sample_rate),
        "-f",
        "f32le",
        "-acodec",
        "pcm_f32le",
        "-",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=_FFMPEG_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise MediaError(f"ffmpeg took too long decoding {path.name}; convert it to WAV.") from None
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        raise MediaError(f"Cannot decode {kind} audio {path.name}: {reason}")
    samples = np.frombuffer(done.stdout[: len(done.stdout) // 4 * 4], "<f4").astype(np.float32)
    if samples.shape[0] == 0:
        raise MediaError(f"Audio file {path.name} contains no audio samples.")
    return samples
