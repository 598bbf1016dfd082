"""The Whisper model the host transcribes with: loaded on first use and kept for the next
request (one at a time: another model's path replaces it)."""

from __future__ import annotations

from typing import Any

from engine.runtime.assembly import LoadProgress

_LOADING = "loading the Whisper model"


class WhisperSlot:
    def __init__(self) -> None:
        self.transcriber: Any = None  # the last Whisper used

    def get(self, path: str, progress: LoadProgress | None = None) -> Any:
        """The Whisper Transcriber for ``path``, loaded once and kept."""
        from engine.artifacts.hub import resolve_model_path
        from engine.media.whisper.transcribe import Transcriber

        folder = str(resolve_model_path(path))
        if self.transcriber is None or self.transcriber.path != folder:
            self.transcriber = None
            if progress is not None:
                progress(0, 1, _LOADING)
            self.transcriber = Transcriber.load(folder)
            if progress is not None:
                progress(1, 1, _LOADING)
        return self.transcriber
