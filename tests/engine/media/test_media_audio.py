"""Audio decoding and resampling.

WAV parsing is checked on files built byte by byte here (known integers -> known floats);
the resampler against scipy.signal.resample_poly (tests/golden/media/resample.npz, made by
tests/golden/make_media_goldens.py) and against analytic sine waves.
"""

from __future__ import annotations

import json
import shutil
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from engine.errors import MediaError
from engine.media.audio import load_audio, sniff_audio_format
from engine.media.resample import lowpass_filter, resample

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"


def wav_bytes(fmt_tag: int, channels: int, rate: int, bits: int, payload: bytes, extensible: bool = False) -> bytes:
    block = channels * bits // 8
    if extensible:
        # WAVE_FORMAT_EXTENSIBLE: cbSize 22, valid bits, channel mask, SubFormat GUID
        guid = struct.pack("<H", fmt_tag) + bytes.fromhex("000000001000800000aa00389b71")
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * block, block, bits, 22, bits, 0) + guid
    else:
        fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"LIST" + struct.pack("<I", 4) + b"INFO"  # an extra chunk to skip
    body += b"data" + struct.pack("<I", len(payload)) + payload + (b"\x00" if len(payload) % 2 else b"")
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_pcm_widths_decode_to_exact_floats(tmp_path):
    cases = {
        # bits: (raw integers, how they are stored, full scale)
        8: (np.array([0, 64, 128, 192, 255]), lambda v: v.astype(np.uint8).tobytes(), None),
        16: (np.array([-32768, -1, 0, 1, 16384, 32767]), lambda v: v.astype("<i2").tobytes(), 32768),
        32: (np.array([-(2**31), -5, 0, 7, 2**30, 2**31 - 1]), lambda v: v.astype("<i4").tobytes(), 2**31),
    }
    for bits, (ints, pack, scale) in cases.items():
        path = tmp_path / f"pcm{bits}.wav"
        path.write_bytes(wav_bytes(1, 1, 16000, bits, pack(ints)))
        got = load_audio(path, 16000)
        expected = (ints - 128) / 128 if bits == 8 else ints / scale
        np.testing.assert_allclose(got, expected.astype(np.float32), rtol=0, atol=1e-7, err_msg=f"{bits}-bit")
        assert got.dtype == np.float32


def test_pcm24_including_extensible_header(tmp_path):
    ints = np.array([-(2**23), -1, 0, 1, 2**22, 2**23 - 1])
    raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    for extensible in (False, True):
        path = tmp_path / f"pcm24_{extensible}.wav"
        path.write_bytes(wav_bytes(1, 1, 16000, 24, raw, extensible=extensible))
        np.testing.assert_array_equal(load_audio(path), (ints / 2**23).astype(np.float32))


def test_float_wav_32_and_64_bit(tmp_path):
    values = np.array([-1.0, -0.25, 0.0, 0.123456, 0.5, 1.0])
    for bits, dtype in ((32, "<f4"), (64, "<f8")):
        for extensible in (False, True):
            path = tmp_path / f"f{bits}_{extensible}.wav"
            path.write_bytes(wav_bytes(3, 1, 16000, bits, values.astype(dtype).tobytes(), extensible))
            np.testing.assert_array_equal(load_audio(path), values.astype(np.float32))


def test_stereo_is_averaged(tmp_path):
    left = np.array([1000, -2000, 3000, 32767], dtype="<i2")
    right = np.array([-1000, 2000, 1000, 32767], dtype="<i2")
    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.stack([left, right], axis=1).tobytes())
    expected = (left.astype(np.float64) + right) / 2 / 32768
    np.testing.assert_allclose(load_audio(path), expected, atol=1e-7)


def test_jfk_wav_loads_at_native_rate(shared_data):
    audio = load_audio(shared_data / "audio" / "jfk.wav", 16000)
    assert audio.shape == (176000,) and audio.dtype == np.float32
    assert 0.05 < np.abs(audio).max() <= 1.0


def test_wav_at_another_rate_is_resampled_to_the_requested_rate(tmp_path):
    """A 48 kHz 440 Hz tone read at 16 kHz equals the same tone sampled at 16 kHz."""
    t48 = np.arange(48000) / 48000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t48)
    path = tmp_path / "tone48k.wav"
    path.write_bytes(wav_bytes(3, 1, 48000, 32, tone.astype("<f4").tobytes()))
    got = load_audio(path, 16000)
    assert got.shape == (16000,)
    t16 = np.arange(16000) / 16000
    interior = slice(200, -200)  # away from the zero-padded ends
    np.testing.assert_allclose(got[interior], 0.5 * np.sin(2 * np.pi * 440 * t16)[interior], atol=1e-3)


# ---- resampler -------------------------------------------------------------------


def _golden(name: str) -> dict:
    with np.load(GOLDEN / name) as z:
        return {k: z[k] for k in z.files}


def _tone_mix(rate: int, seconds: float) -> np.ndarray:
    meta = json.loads((GOLDEN / "versions.json").read_text())
    tones = meta["tones_hz"]
    t = np.arange(int(rate * seconds)) / rate
    return sum(np.sin(2 * np.pi * f * t + i) / len(tones) for i, f in enumerate(tones))


def _check_against_golden(gold: dict, name: str, ours: np.ndarray, stride: int) -> None:
    assert tuple(gold[f"{name}/shape"]) == ours.shape
    # scipy works in float64, ours returns float32: agreement to float32 rounding.
    np.testing.assert_allclose(ours[::stride], gold[f"{name}/strided"], rtol=0, atol=1e-6)
    total, abs_total, energy, lo, hi = gold[f"{name}/stats"]
    o64 = ours.astype(np.float64)
    sums = [o64.sum(), np.abs(o64).sum(), (o64**2).sum()]
    np.testing.assert_allclose(sums, [total, abs_total, energy], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose([o64.min(), o64.max()], [lo, hi], atol=1e-6)


def test_resampler_matches_scipy_resample_poly_on_speech(shared_data):
    gold = _golden("resample.npz")
    stride = json.loads((GOLDEN / "versions.json").read_text())["resample_stride"]
    with wave.open(str(shared_data / "audio" / "jfk.wav")) as w:
        jfk = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768.0
    _check_against_golden(gold, "jfk_16000_to_22050", resample(jfk, 16000, 22050), stride)
    _check_against_golden(gold, "jfk_16000_to_8000", resample(jfk, 16000, 8000), stride)


def test_resampler_matches_scipy_resample_poly_on_tones():
    gold = _golden("resample.npz")
    stride = json.loads((GOLDEN / "versions.json").read_text())["resample_stride"]
    _check_against_golden(gold, "tones_44100_to_16000", resample(_tone_mix(44100, 2.0), 44100, 16000), stride)
    _check_against_golden(gold, "tones_44100_to_48000", resample(_tone_mix(44100, 0.5), 44100, 48000), stride)


@pytest.mark.parametrize("src,dst,freq", [(44100, 16000, 1000.0), (22050, 16000, 3000.0), (8000, 16000, 2500.0)])
def test_resampled_tone_equals_the_analytic_tone(src, dst, freq):
    x = np.cos(2 * np.pi * freq * np.arange(src) / src)
    y = resample(x, src, dst)
    assert y.shape == (dst,)
    expected = np.cos(2 * np.pi * freq * np.arange(dst) / dst)
    np.testing.assert_allclose(y[100:-100], expected[100:-100], atol=2e-3)


def test_resampler_removes_content_above_the_new_nyquist():
    """A 12 kHz tone cannot exist at 16 kHz; it must be filtered out, not aliased to 4 kHz."""
    x = np.sin(2 * np.pi * 12000 * np.arange(44100) / 44100)
    y = resample(x, 44100, 16000)
    assert np.sqrt(np.mean(y[200:-200] ** 2)) < 3e-3  # input RMS is 0.707


def test_lowpass_filter_has_the_promised_shape():
    h = lowpass_filter(160, 441)
    assert h.shape == (2 * 10 * 441 + 1,)
    np.testing.assert_allclose(h.sum(), 160)
    np.testing.assert_allclose(h, h[::-1])  # linear phase


def test_resample_identity_and_bad_arguments():
    x = np.linspace(-1, 1, 50)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x.astype(np.float32))
    with pytest.raises(ValueError):
        resample(x, 0, 16000)
    with pytest.raises(ValueError):
        resample(np.zeros((2, 5)), 8000, 16000)


# ---- failures --------------------------------------------------------------------


def test_missing_empty_and_corrupt_files_raise_media_error(tmp_path):
    with pytest.raises(MediaError, match="not found"):
        load_audio(tmp_path / "nope.wav")
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(MediaError, match="empty"):
        load_audio(empty)
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(wav_bytes(1, 1, 16000, 16, b"\x01\x00" * 10)[:30])
    with pytest.raises(MediaError, match="truncated.wav"):
        load_audio(truncated)
    no_samples = tmp_path / "silent.wav"
    no_samples.write_bytes(wav_bytes(1, 1, 16000, 16, b""))
    with pytest.raises(MediaError, match="no audio samples"):
        load_audio(no_samples)
    adpcm = tmp_path / "adpcm.wav"
    adpcm.write_bytes(wav_bytes(2, 1, 16000, 4, b"\x00" * 64))
    with pytest.raises(MediaError, match="not (a readable WAV|supported)"):
        load_audio(adpcm)
    nan = tmp_path / "nan.wav"
    nan.write_bytes(wav_bytes(3, 1, 16000, 32, np.array([0.0, np.nan], "<f4").tobytes()))
    with pytest.raises(MediaError, match="NaN"):
        load_audio(nan)


def test_errors_are_one_line(tmp_path):
    path = tmp_path / "x.wav"
    path.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    with pytest.raises(MediaError) as info:
        load_audio(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "head,suffix,kind",
    [
        (b"ID3\x04\x00", ".mp3", "MP3"),
        (b"\xff\xfb\x90\x00", "", "MP3"),
        (b"fLaC\x00\x00", ".flac", "FLAC"),
        (b"OggS\x00\x02", ".ogg", "OGG"),
        (b"\x00\x00\x00\x20ftypM4A ", ".m4a", "M4A"),
        (b"RIFF\x00\x00\x00\x00WAVE", ".bin", "WAV"),
    ],
)
def test_format_sniffing(head, suffix, kind):
    assert sniff_audio_format(head, suffix) == kind


def test_compressed_audio_without_ffmpeg_names_the_format_and_the_fix(shared_data, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ffmpeg anywhere on PATH
    with pytest.raises(MediaError, match=r"MP3.*install ffmpeg.*WAV"):
        load_audio(shared_data / "audio" / "jfk.mp3")


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_mp3_through_ffmpeg_matches_the_wav(shared_data):
    wav = load_audio(shared_data / "audio" / "jfk.wav")
    mp3 = load_audio(shared_data / "audio" / "jfk.mp3")
    assert abs(mp3.shape[0] - wav.shape[0]) < 16000 * 0.2  # decoder padding differs
    n = min(wav.shape[0], mp3.shape[0])
    core = slice(2000, n - 2000)

    def overlap(lag: int) -> float:
        return float(np.dot(wav[core], np.roll(mp3[:n], -lag)[core]))

    lag = max(range(-2000, 2001), key=overlap)  # MP3 decoders add a small delay
    assert np.corrcoef(wav[core], np.roll(mp3[:n], -lag)[core])[0, 1] > 0.95


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_garbage_through_ffmpeg_is_a_media_error(tmp_path):
    path = tmp_path / "broken.ogg"
    path.write_bytes(b"OggS" + bytes(range(256)) * 4)
    with pytest.raises(MediaError, match="broken.ogg"):
        load_audio(path)
