"""Audio in the window: the microphone recorder's buffering, level meter and WAV output
(over a fake input stream: there is no sound card here), the no-microphone message,
and where dropped or recorded audio goes for a model that cannot listen."""

from __future__ import annotations

import sys
import threading
import wave
from pathlib import Path

import numpy as np
import pytest

from app.attachments import NO_WHISPER
from app.recorder import TARGET_RATE, Recorder, RecorderError, rms_level, write_wav
from engine import api

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


class FakeStream:
    """Stands in for sounddevice.InputStream: the test plays PortAudio's thread."""

    opened: list[FakeStream] = []

    def __init__(self, samplerate: int, channels: int, callback):
        self.samplerate, self.channels, self.callback = samplerate, channels, callback
        self.started = self.closed = False
        FakeStream.opened.append(self)

    def start(self):
        self.started = True

    def stop(self):
        self.started = False

    def close(self):
        self.closed = True

    def feed(self, signal: np.ndarray, block: int = 512, channels: int = 1) -> None:
        """Deliver ``signal`` in blocks from another thread, as PortAudio does."""

        def run():
            for start in range(0, len(signal), block):
                chunk = signal[start : start + block].astype(np.float32)
                data = np.repeat(chunk[:, None], channels, axis=1)
                self.callback(data, len(chunk), None, None)
                data[:] = 9.0  # PortAudio reuses its buffer: the recorder must have copied

        t = threading.Thread(target=run)
        t.start()
        t.join()


def sine(freq: float, seconds: float, rate: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_recorder_buffers_blocks_and_writes_a_16k_mono_wav(tmp_path):
    rec = Recorder(FakeStream)
    rec.start()
    stream = FakeStream.opened[-1]
    assert stream.started and stream.samplerate == TARGET_RATE and rec.recording
    tone = sine(440, 0.75, TARGET_RATE)
    stream.feed(tone, channels=2)  # a stereo device: averaged to mono
    assert rec.elapsed_s == pytest.approx(0.75)
    # RMS of a 0.5 sine is -9.03 dBFS: 0.85 on the -60..0 dB meter.
    assert rec.level == pytest.approx((60 + 20 * np.log10(0.5 / np.sqrt(2))) / 60, abs=0.02)
    samples = rec.stop()
    assert stream.closed and not rec.recording and rec.level == 0.0
    np.testing.assert_allclose(samples, tone, atol=1e-7)

    path = tmp_path / "take.wav"
    write_wav(path, samples)
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        back = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    np.testing.assert_array_equal(back, np.round(tone * 32767).astype(np.int16))


def test_a_device_at_48k_is_resampled_to_16k():
    rec = Recorder(FakeStream, rates=[48_000])
    rec.start()
    FakeStream.opened[-1].feed(sine(1000, 1.0, 48_000))
    samples = rec.stop()
    assert len(samples) == 16_000
    spectrum = np.abs(np.fft.rfft(samples[2000:-2000]))
    peak_hz = np.argmax(spectrum) * TARGET_RATE / len(samples[2000:-2000])
    assert abs(peak_hz - 1000) < 2


def test_level_meter_scale():
    assert rms_level(np.zeros(256, np.float32)) == 0.0
    assert rms_level(np.ones(256, np.float32)) == pytest.approx(1.0)
    assert rms_level(np.full(256, 0.001, np.float32)) == pytest.approx(0.0, abs=1e-6)  # -60 dB
    assert rms_level(np.full(256, 0.0316, np.float32)) == pytest.approx(0.5, abs=0.01)  # -30 dB


def test_no_input_device_gives_a_clear_message(qtbot, make_window, monkeypatch):
    """With sounddevice itself (skipped where a microphone exists), and with a PortAudio
    that reports no default input, and with PortAudio missing altogether."""
    window = make_window()
    composer = window.composer

    def press_mic() -> str:
        with qtbot.wait_signal(composer.refused, timeout=10_000) as blocker:
            composer.mic_button.click()
        assert not composer.mic_button.isChecked() and composer.recorder is None
        assert window.error_banner.text() == blocker.args[0]
        return blocker.args[0]

    try:
        import sounddevice  # loads PortAudio: an OSError where the library is missing
    except OSError:
        sounddevice = None
        assert "PortAudio library" in press_mic()  # the real case this test is named after
    if sounddevice is not None:
        try:
            sounddevice.query_devices(kind="input")
            has_input = True
        except sounddevice.PortAudioError:
            has_input = False
        if not has_input:
            assert press_mic().startswith("No microphone found")

    class PortAudioError(Exception):
        pass

    class NoInput:  # PortAudio's answer on a machine without an input device
        @staticmethod
        def query_devices(kind=None):
            raise NoInput.PortAudioError("Error querying device -1")

    NoInput.PortAudioError = sounddevice.PortAudioError if sounddevice is not None else PortAudioError
    monkeypatch.setitem(sys.modules, "sounddevice", NoInput)
    assert press_mic().startswith("No microphone found: connect one")

    class NoPortAudio:  # importing sounddevice without the PortAudio library
        def find_spec(self, name, path=None, target=None):
            if name == "sounddevice":
                raise OSError("PortAudio library not found")
            return None

    monkeypatch.delitem(sys.modules, "sounddevice")
    monkeypatch.setattr(sys, "meta_path", [NoPortAudio(), *sys.meta_path])
    assert "PortAudio library" in press_mic()
    with pytest.raises(RecorderError, match="PortAudio"):
        Recorder().start()


def test_recording_meter_then_audio_goes_to_transcription(qtbot, make_window, tmp_path):
    window = make_window()
    composer = window.composer
    composer.recorder_factory = lambda: Recorder(FakeStream)
    composer.mic_button.click()
    assert composer.mic_button.isChecked() and composer.level_bar.isVisible()
    FakeStream.opened[-1].feed(sine(300, 1.25, TARGET_RATE))
    qtbot.waitUntil(lambda: composer.level_bar.value() > 50, timeout=5_000)
    qtbot.waitUntil(lambda: composer.rec_label.text() == "● 0:01", timeout=5_000)

    # No audio model and no Whisper model chosen: the take is kept, and the user is
    # told what to do.
    with qtbot.wait_signal(composer.transcribe_requested) as blocker:
        composer.mic_button.click()
    wav = Path(blocker.args[0])
    assert wav.parent == (window.store.data_dir / "attachments").resolve()
    with wave.open(str(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 20_000)
    assert not composer.level_bar.isVisible() and not composer.mic_button.isChecked()
    qtbot.waitUntil(lambda: window.error_banner.text() == NO_WHISPER, timeout=5_000)
    assert window.settings.isVisible()  # opened where the Whisper model is chosen
    assert composer.attachments == []  # a text model gets the words, not the audio


def test_dropped_audio_is_transcribed_into_the_message_box(
    qtbot, make_window, run_async, tiny_model, tmp_path, monkeypatch, shared_data
):
    """A text model, a Whisper model chosen in Settings: the transcript lands in the box,
    editable, with progress shown while the engine works."""
    monkeypatch.delenv("MLX_DESK_WHISPER", raising=False)
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    if hasattr(api, "Transcribe"):
        from tests.engine.media.audio_checkpoints import write_whisper_folder

        whisper = write_whisper_folder(tmp_path / "whisper-tiny-random")
    else:
        whisper = tmp_path / "whisper-tiny-random"
        whisper.mkdir()
    window.set_whisper_model(str(whisper))
    assert window.store.preference("whisper_model") == str(whisper)
    assert window.settings.whisper_label.text() == "Whisper: whisper-tiny-random"

    window.composer.edit.setPlainText("Here is what I said:")
    window.composer.edit.moveCursor(window.composer.edit.textCursor().MoveOperation.End)
    seen: list[bool] = []
    window.bridge.progress.connect(lambda *a: seen.append(window.composer.transcribe_row.isVisible()))
    from tests.app.test_app_images import drop, url_mime

    clip = shared_data / "audio" / "jfk.wav"
    with qtbot.wait_signal(window.transcription_finished, timeout=120_000):
        drop(window.composer, url_mime(clip))
    assert not window.composer.transcribe_row.isVisible()
    assert window.composer.attachments == []  # the words go, not the audio
    if not hasattr(api, "Transcribe"):  # an engine from before speech-to-text
        assert window.error_banner.text().startswith(
            "Could not transcribe jfk.wav: This engine cannot transcribe audio yet"
        )
        return
    text = window.composer.edit.toPlainText()
    assert text.startswith("Here is what I said: ") and len(text) > len("Here is what I said: ")
    assert seen and all(seen)  # progress arrived while the transcription row showed
    assert "Transcribed jfk.wav" in window.statusBar().currentMessage()


def test_an_audio_model_takes_the_clip_as_an_attachment(qtbot, make_window, tmp_path):
    window = make_window()
    composer = window.composer
    composer.set_capabilities(image=False, audio=True)  # what an audio model's ModelInfo says
    clip = tmp_path / "note.wav"
    write_wav(clip, sine(200, 0.25, TARGET_RATE))
    composer.add_files([str(clip)])
    assert composer.attachments == [("audio", str(clip))]
    assert "note.wav" in composer.strip.items[0].item.picture.text()
