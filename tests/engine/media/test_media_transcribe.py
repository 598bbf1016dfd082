"""Transcription against transformers' WhisperForConditionalGeneration.generate.

tests/golden/make_audio_goldens.py builds a tiny random multilingual Whisper (languages
en/de/fr, suppress_tokens, begin_suppress_tokens, <|endoftext|> placed where greedy
decoding reaches it) and stores transformers' greedy ids on ../shared/data/audio/jfk.wav:
with language detection, with a given language, and long-form on a 33 s clip.
"""

from __future__ import annotations

import threading
import wave
from pathlib import Path

import numpy as np
import pytest

from engine.errors import EngineError, MediaError, ModelLoadError, UnsupportedModelError
from engine.media.audio import load_audio
from engine.media.whisper.transcribe import Transcriber
from tests.engine.media.audio_checkpoints import load_arrays, load_meta, write_whisper_folder

META = load_meta("whisper_asr")


@pytest.fixture(scope="module")
def gold() -> dict:
    return load_arrays("whisper_asr")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_whisper_folder(tmp_path_factory.mktemp("whisper") / "whisper-tiny-random")


@pytest.fixture(scope="module")
def transcriber(folder) -> Transcriber:
    return Transcriber.load(folder)


@pytest.fixture(scope="module")
def jfk(shared_data) -> np.ndarray:
    return load_audio(shared_data / "audio" / "jfk.wav", 16000)


def _expected(ids: np.ndarray, eot: int) -> tuple[list[int], list[int]]:
    """(forced prompt, generated ids without the end-of-text token) of a reference sequence."""
    ids = ids.tolist()
    body = ids[4:]
    return ids[:4], body[:-1] if body and body[-1] == eot else body


def test_settings_come_from_the_generation_config(transcriber):
    s = transcriber.settings
    gen = META["generation_config"]
    assert s.start_id == gen["decoder_start_token_id"] and s.eos_id == gen["eos_token_id"]
    assert s.lang_to_id == {"en": 101, "de": 102, "fr": 103}
    assert s.suppress_tokens == gen["suppress_tokens"] and s.begin_suppress_tokens == gen["begin_suppress_tokens"]
    assert transcriber.languages == ["de", "en", "fr"]


def test_detected_language_and_greedy_ids_match_transformers(transcriber, shared_data, gold):
    eot = META["config"]["eos_token_id"]
    prompt, expected = _expected(gold["detect/ids"], eot)
    result = transcriber.transcribe(shared_data / "audio" / "jfk.wav", max_new_tokens=META["max_new_tokens"])
    assert result.language == META["detected_language"]
    assert transcriber.prompt_ids(result.language) == prompt
    assert len(result.segments) == 1
    assert result.segments[0].token_ids == expected
    assert result.finish_reason == "stop"
    assert result.duration_s == pytest.approx(11.0)
    assert result.segments[0].end_s == pytest.approx(11.0)
    # Text: the tokenizer's words for the ordinary ids; specials and timestamps left out.
    words = [f"w{i}" for i in expected if i < META["n_ordinary"]]
    assert result.text == " ".join(words)


def test_given_language_forces_its_token(transcriber, jfk, gold):
    eot = META["config"]["eos_token_id"]
    prompt, expected = _expected(gold["given/ids"], eot)
    result = transcriber.transcribe(jfk, language=META["given_language"], max_new_tokens=META["max_new_tokens"])
    assert transcriber.prompt_ids(META["given_language"]) == prompt
    assert result.language == META["given_language"]
    assert result.segments[0].token_ids == expected


def test_long_audio_goes_through_long_form_decoding(transcriber, jfk, gold):
    """33 s: whole-clip features, timestamped windows. This checkpoint's 18 timestamps never
    close a segment, so each window is one segment and the next starts 30 s on."""
    long = np.concatenate([jfk, jfk, jfk])
    seen = []
    result = transcriber.transcribe(
        long, max_new_tokens=META["max_new_tokens"], on_window=lambda done, total: seen.append((done, total))
    )
    assert seen == [(1, 2), (2, 2)]
    bounds, tokens = gold["long/bounds"], gold["long/tokens"].tolist()
    assert len(result.segments) == META["long_windows"] == len(bounds) - 1 == 2
    assert [(s.start_s, s.end_s) for s in result.segments] == [tuple(t) for t in gold["long/times"].tolist()]
    for w, seg in enumerate(result.segments):
        assert seg.token_ids == tokens[bounds[w] : bounds[w + 1]], f"window {w}"
    assert result.text == " ".join(s.text for s in result.segments if s.text)


def test_stereo_44k_wav_goes_through_resampling(transcriber, jfk, tmp_path):
    """A 44.1 kHz stereo file of the clip transcribes like the 16 kHz original would,
    up to resampling error: same language, and the same first tokens."""
    from engine.media.resample import resample

    up = resample(jfk, 16000, 44100)
    stereo = np.stack([up, 0.5 * up], axis=1)
    path = tmp_path / "jfk44k.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes((np.clip(stereo, -1, 1) * 32767).astype("<i2").tobytes())
    back = load_audio(path, 16000)
    assert abs(back.shape[0] - jfk.shape[0]) <= 1
    ref = transcriber.transcribe(0.75 * jfk[: back.shape[0]], max_new_tokens=8)
    got = transcriber.transcribe(path, max_new_tokens=8)
    assert got.language == ref.language
    assert got.duration_s == pytest.approx(11.0, abs=1e-3)
    assert got.segments[0].token_ids[:4] == ref.segments[0].token_ids[:4]


def test_cancel_returns_what_was_done(transcriber, jfk):
    cancel = threading.Event()
    cancel.set()
    result = transcriber.transcribe(np.concatenate([jfk, jfk, jfk]), cancel=cancel)
    assert result.finish_reason == "cancelled"
    assert result.segments == []


def test_unknown_language_and_undecodable_file_are_refused(transcriber, tmp_path):
    with pytest.raises(EngineError, match="does not know language 'xx'"):
        transcriber.transcribe(np.zeros(16000, np.float32), language="xx")
    bad = tmp_path / "note.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunk")
    with pytest.raises(MediaError, match="note.wav"):
        transcriber.transcribe(bad)


def test_folders_that_are_not_whisper_are_refused(tmp_path, folder):
    with pytest.raises(ModelLoadError, match="config.json"):
        Transcriber.load(tmp_path)
    other = tmp_path / "llm"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedModelError, match="not a Whisper model"):
        Transcriber.load(other)


def test_without_generation_config_ids_come_from_the_tokenizer(tmp_path):
    """An old folder with no generation_config.json: tokens found by name, no suppression."""
    t = Transcriber.load(write_whisper_folder(tmp_path / "old", generation_config=False))
    s = t.settings
    assert s.start_id == 100 and s.no_timestamps_id == 109 and s.transcribe_id == 105
    assert s.eos_id == META["config"]["eos_token_id"]
    assert s.lang_to_id == {"en": 101, "de": 102, "fr": 103}
    # A vocabulary smaller than Whisper's multilingual one reads as English-only.
    assert not s.multilingual and t.prompt_ids(None) == [100, 109]
    assert s.suppress_tokens == []
