"""Microphone recording: sounddevice's callback thread fills a buffer, the GUI polls it.

PortAudio calls ``_on_block`` on its own thread for every block of samples; the block
is copied (PortAudio reuses its buffer) and appended under a lock. The GUI reads
``level`` and ``elapsed_s`` on a timer for the meter, and ``stop`` hands back the
whole take as 16 kHz mono, which ``write_wav`` stores as 16-bit PCM (what Whisper and
the audio towers read). sounddevice is imported only when recording starts, because
the PortAudio library it loads may be missing. No Qt here.
"""

from __future__ import annotations

import threading
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

TARGET_RATE = 16_000


class RecorderError(Exception):
    """Recording cannot start or went wrong; ``str()`` is one readable line."""


def rms_level(block: np.ndarray) -> float:
    """Loudness of a block on a 0..1 meter scale: RMS in dBFS mapped from -60..0 dB
    (speech reads around the middle; silence at 0)."""
    if block.size == 0:
        return 0.0
    rms = float(np.sqrt(np.mean(np.square(block, dtype=np.float64))))
    if rms <= 1e-6:
        return 0.0
    db = 20.0 * np.log10(rms)
    return float(min(1.0, max(0.0, (db + 60.0) / 60.0)))


def to_mono(block: np.ndarray) -> np.ndarray:
    block = np.asarray(block, dtype=np.float32)
    return block.mean(axis=1) if block.ndim == 2 else block.reshape(-1)


def write_wav(target: str | Path | BinaryIO, samples: np.ndarray, sample_rate: int = TARGET_RATE) -> None:
    """Mono float samples in [-1, 1] as a 16-bit PCM WAV file (a path or a binary file)."""
    pcm = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    ints = np.round(pcm * 32767.0).astype("<i2")
    with wave.open(str(target) if isinstance(target, (str, Path)) else target, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(ints.tobytes())


def _sounddevice() -> Any:
    try:
        import sounddevice  # loads the PortAudio library
    except OSError as exc:
        raise RecorderError(
            "Recording needs the PortAudio library, which is missing "
            "(Linux: install libportaudio2; macOS: it comes with the app)."
        ) from exc
    except ImportError as exc:
        raise RecorderError("Recording needs the sounddevice package (pip install sounddevice).") from exc
    return sounddevice


def _device_problem(exc: BaseException) -> RecorderError:
    text = " ".join(str(exc).split())
    lowered = text.lower()
    if "querying device -1" in lowered or "no default input" in lowered or "device unavailable" in lowered:
        return RecorderError(
            "No microphone found: connect one (or pick it as the system's input device), then press record again."
        )
    if "permission" in lowered or "not authorized" in lowered or "-9986" in lowered:
        return RecorderError(
            "The microphone is blocked: allow MLX Desk under System Settings → "
            "Privacy & Security → Microphone, then press record again."
        )
    return RecorderError(f"The microphone could not start: {text}")


class Recorder:
    """One take at a time. ``stream_factory(samplerate, channels, callback)`` returns an
    object with ``start()``, ``stop()`` and ``close()`` (default: sounddevice.InputStream);
    tests pass a fake one and call the callback themselves. ``rates`` are the sample rates
    tried in order (default: 16 kHz, then the input device's own rate)."""

    def __init__(self, stream_factory: Callable[..., Any] | None = None, rates: list[int] | None = None) -> None:
        self._factory = stream_factory
        self._given_rates = rates
        self._lock = threading.Lock()
        self._blocks: list[np.ndarray] = []
        self._frames = 0
        self._level = 0.0
        self._rate = TARGET_RATE
        self._stream: Any = None
        self.overflows = 0  # blocks PortAudio reported as dropped

    # ---- GUI side ---------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self._stream is not None

    @property
    def level(self) -> float:
        with self._lock:
            return self._level

    @property
    def elapsed_s(self) -> float:
        with self._lock:
            return self._frames / self._rate

    def start(self) -> None:
        """Open the default input and start filling the buffer; RecorderError says why not."""
        if self._stream is not None:
            return
        with self._lock:
            self._blocks, self._frames, self._level, self.overflows = [], 0, 0.0, 0
        factory = self._factory or self._default_factory()
        stream = None
        last: BaseException | None = None
        # 16 kHz straight from the device where it can; its own rate (resampled at stop) if not.
        for rate in self._rates():
            try:
                stream = factory(samplerate=rate, channels=1, callback=self._on_block)
                stream.start()
            except RecorderError:
                raise
            except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
                last, stream = exc, None
                continue
            self._rate = rate
            break
        if stream is None:
            raise _device_problem(last or RuntimeError("no input"))
        self._stream = stream

    def stop(self) -> np.ndarray:
        """End the take; its samples as 16 kHz mono float32."""
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.stop()
            finally:
                stream.close()
        with self._lock:
            samples = np.concatenate(self._blocks) if self._blocks else np.zeros(0, np.float32)
            rate, self._level = self._rate, 0.0
        if rate != TARGET_RATE and samples.size:
            from engine.media.resample import resample  # numpy only

            samples = resample(samples, rate, TARGET_RATE).astype(np.float32)
        return samples

    def cancel(self) -> None:
        self.stop()
        with self._lock:
            self._blocks, self._frames = [], 0

    # ---- PortAudio's thread ------------------------------------------------------------

    def _on_block(self, indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        block = to_mono(indata).copy()  # PortAudio reuses indata's memory
        level = rms_level(block)
        with self._lock:
            self._blocks.append(block)
            self._frames += len(block)
            self._level = level
            if status:
                self.overflows += 1

    # ---- the real device -----------------------------------------------------------------

    def _rates(self) -> list[int]:
        if self._given_rates:
            return list(self._given_rates)
        if self._factory is not None:
            return [TARGET_RATE]
        sd = _sounddevice()
        try:
            info = sd.query_devices(kind="input")
        except Exception as exc:  # noqa: BLE001 - PortAudioError: no default input device
            raise _device_problem(exc) from exc
        native = int(info.get("default_samplerate") or 0)
        return [TARGET_RATE] + ([native] if native and native != TARGET_RATE else [])

    @staticmethod
    def _default_factory() -> Callable[..., Any]:
        sd = _sounddevice()

        def open_stream(samplerate: int, channels: int, callback: Callable) -> Any:
            return sd.InputStream(samplerate=samplerate, channels=channels, dtype="float32", callback=callback)

        return open_stream
