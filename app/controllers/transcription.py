"""TranscriptionController: audio for a model that cannot listen goes through the Whisper
model chosen in Settings, and the text lands in the message box to check before sending."""

from __future__ import annotations

import os
from pathlib import Path

from app.attachments import NO_WHISPER
from app.bridge import EngineBridge, EngineRequestError, EngineUnavailable, RequestEvents
from app.qt import QObject, Signal, emit
from app.store import HistoryStore

WHISPER_KEY = "whisper_model"  # preference: the Whisper folder that transcribes audio
WHISPER_ENV = "MLX_DESK_WHISPER"  # the engine's fallback, honoured here too


class TranscriptionController(QObject):
    status = Signal(str)
    failed = Signal(str)
    whisper_needed = Signal()  # no Whisper model chosen: Settings should open
    whisper_changed = Signal(object)  # the chosen folder, or None
    started = Signal(str)  # the file's name
    ended = Signal()
    transcribed = Signal(str)  # text for the message box
    finished = Signal(str)  # the transcript put in the box ("" when none), after every attempt
    progress = Signal(float, float)  # done, total (the engine's units)

    def __init__(self, store: HistoryStore, bridge: EngineBridge, parent: QObject | None = None):
        super().__init__(parent)
        self.store, self.bridge = store, bridge

    @property
    def whisper_model(self) -> str | None:
        return self.store.preference(WHISPER_KEY) or os.environ.get(WHISPER_ENV) or None

    def set_whisper_model(self, path: str | None) -> None:
        """Remember the Whisper model that transcribes audio (None forgets it)."""
        self.store.set_preference(WHISPER_KEY, path)
        emit(self.whisper_changed, path)
        emit(
            self.status,
            f"Audio is transcribed with {Path(path).name}."
            if path
            else "No Whisper model: audio can go only to an audio model.",
        )

    def cancel(self) -> bool:
        return self.bridge.cancel(self.bridge.active_transcription) if self.bridge.active_transcription else False

    async def transcribe(self, path: str) -> str | None:
        """The text of ``path``, put in the message box; None when there is none."""
        text = None
        try:
            text = await self._transcribe(path)
        finally:
            emit(self.finished, text or "")
        return text

    async def _transcribe(self, path: str) -> str | None:
        name = Path(path).name
        whisper = self.whisper_model
        if not whisper:
            emit(self.failed, NO_WHISPER)
            emit(self.whisper_needed)
            return None
        if self.bridge.active_transcription is not None:
            emit(self.status, f"{name}: one transcription at a time; wait for this one or cancel it.")
            return None
        emit(self.started, name)
        try:
            transcript = await self.bridge.transcribe(
                path,
                whisper,
                events=RequestEvents(progress=lambda _stage, done, total, _m: emit(self.progress, done, total)),
            )
        except (EngineRequestError, EngineUnavailable) as exc:
            emit(self.failed, f"Could not transcribe {name}: {exc}")
            return None
        finally:
            emit(self.ended)
        if transcript.finish_reason == "cancelled":
            emit(self.status, f"Stopped transcribing {name}.")
            return None
        text = transcript.text.strip()
        if not text:
            emit(self.status, f"No speech was found in {name}.")
            return None
        emit(self.transcribed, text)
        length = transcript.duration_s
        language = transcript.language or ""
        extra = ", ".join(x for x in (f"{length:.0f} s" if length else "", language) if x)
        emit(self.status, f"Transcribed {name}{f' ({extra})' if extra else ''}: check the text, then send.")
        return text
