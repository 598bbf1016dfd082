"""The Transcribe command through the real worker thread: events, errors, cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.api import Cancel, DoneEvent, ErrorEvent, ProgressEvent, Transcribe, Transcript
from engine.media.whisper.transcribe import WHISPER_ENV
from engine.runtime.worker import EngineWorker
from tests.engine.media.audio_checkpoints import load_arrays, load_meta, write_whisper_folder

META = load_meta("whisper_asr")


class Events:
    def __init__(self) -> None:
        self.items: list = []
        self.cond = threading.Condition()

    def __call__(self, event) -> None:
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def end_of(self, rid: int, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.items:
                    if isinstance(e, DoneEvent | ErrorEvent) and e.request_id == rid:
                        return e
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; events: {self.items[-5:]}"
                self.cond.wait(left)

    def of(self, rid: int, kind) -> list:
        with self.cond:
            return [e for e in self.items if isinstance(e, kind) and getattr(e, "request_id", None) == rid]


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return write_whisper_folder(tmp_path_factory.mktemp("w") / "whisper-tiny-random")


@pytest.fixture()
def worker(monkeypatch):
    monkeypatch.delenv(WHISPER_ENV, raising=False)
    events = Events()
    w = EngineWorker(events)
    w.start()
    yield w, events
    assert w.shutdown(10)


def test_transcribe_reports_windows_and_returns_a_transcript(worker, whisper_dir, shared_data):
    w, ev = worker
    gold = load_arrays("whisper_asr")
    rid = w.submit(Transcribe(str(shared_data / "audio" / "jfk.wav"), model_path=str(whisper_dir)))
    done = ev.end_of(rid)
    assert isinstance(done, DoneEvent), done
    t = done.result
    assert isinstance(t, Transcript) and t.finish_reason == "stop"
    assert t.language == META["detected_language"] and t.model == "whisper-tiny-random"
    # Without max_new_tokens the loop runs until <|endoftext|>, which the reference reached.
    assert t.segments[0].token_ids == gold["detect/ids"].tolist()[4:-1]
    progress = ev.of(rid, ProgressEvent)
    assert [(p.stage, p.done, p.total) for p in progress if p.stage == "transcribe"] == [("transcribe", 1.0, 1.0)]
    assert any(p.stage == "load" for p in progress)


def test_undecodable_file_and_missing_model_are_error_events(worker, whisper_dir, tmp_path, monkeypatch):
    w, ev = worker
    bad = tmp_path / "voice.mp3"
    bad.write_bytes(b"\x00" * 64)
    rid = w.submit(Transcribe(str(bad), model_path=str(whisper_dir)))
    err = ev.end_of(rid)
    assert isinstance(err, ErrorEvent) and err.kind == "MediaError"
    assert "voice.mp3" in err.message
    rid = w.submit(Transcribe(str(tmp_path / "missing.wav"), model_path=str(whisper_dir)))
    err = ev.end_of(rid)
    assert isinstance(err, ErrorEvent) and "not found" in err.message
    rid = w.submit(Transcribe(str(bad)))
    err = ev.end_of(rid)
    assert isinstance(err, ErrorEvent) and err.kind == "NoWhisperModel"
    assert "--whisper" in err.message and WHISPER_ENV in err.message
    # The environment variable is the fallback default.
    monkeypatch.setenv(WHISPER_ENV, str(whisper_dir))
    rid = w.submit(Transcribe(str(bad)))
    assert ev.end_of(rid).kind == "MediaError"


def test_cancel_stops_a_long_transcription(worker, whisper_dir, shared_data, tmp_path):
    """Cancel lands between decoding steps; the transcript holds the windows done so far."""
    import wave

    from engine.media.audio import load_audio

    jfk = load_audio(shared_data / "audio" / "jfk.wav")
    long = np.concatenate([jfk] * 9)  # 99 s: four windows
    path = tmp_path / "long.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes((long * 32767).astype("<i2").tobytes())
    w, ev = worker
    rid = w.submit(Transcribe(str(path), model_path=str(whisper_dir), language="en"))
    deadline = time.monotonic() + 60
    while not [p for p in ev.of(rid, ProgressEvent) if p.stage == "transcribe"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    w.submit(Cancel(rid))
    done = ev.end_of(rid)
    assert isinstance(done, DoneEvent)
    assert done.result.finish_reason == "cancelled"
    assert 1 <= len(done.result.segments) < 4
    assert done.result.language == "en"
