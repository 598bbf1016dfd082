"""Attached video in the window: a poster frame and the duration for the strip, a note
when the model will see only part of the frames, and playback on click.

The poster comes from the engine's PyAV reader (the first frame; no mlx), decoded off the
GUI thread like an image's thumbnail, and the same reader's one-line refusals (corrupt,
no video stream) take a bad file off again at once. Playback uses QtMultimedia
when the installed Qt has it, else the system's player.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.qt import QDesktopServices, QDialog, QImage, QUrl, QVBoxLayout, QWidget
from app.ui.images import _decoders, _rounded_square
from engine.api import VideoLimits

# Qwen3-VL's video processor defaults (2 frames a second, at most 768 frames): the note's
# figures only when the engine has not said what the loaded model's processor takes.
SAMPLE_FPS = 2.0
MAX_FRAMES = 768


def duration_text(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def sampling_note(name: str, seconds: float, limits: VideoLimits | None = None) -> str | None:
    """What the model will see of a long clip (None: every sampled second of it), by the
    loaded model's video limits (ModelInfo.video_limits)."""
    fps, max_frames = (limits.fps, limits.max_frames) if limits is not None else (SAMPLE_FPS, MAX_FRAMES)
    if seconds * fps <= max_frames:
        return None
    return (
        f"{name} is {duration_text(seconds)} long: the model sees {max_frames} frames spread evenly over it "
        f"(its limit), not {fps:g} a second."
    )


@dataclass(frozen=True)
class VideoCheck:
    """An attached video, checked: ``problem`` is the engine's reason it cannot be sent
    (None: it decodes), ``thumb`` the poster (null with a problem), ``seconds`` its
    length and ``note`` what the model will see of a long one."""

    path: str
    problem: str | None
    thumb: QImage
    seconds: float = 0.0
    note: str | None = None


def check_video(
    path: str | Path, size: int, ratio: float = 1.0, radius: int = 8, limits: VideoLimits | None = None
) -> VideoCheck:
    """Read the clip's facts and first frame (the engine's check); slow for a large
    file: run it as an ``app.ops.Op``. ``limits``: the loaded model's, for the note."""
    from engine.errors import MediaError
    from engine.media.video import poster

    px = max(1, round(size * ratio))
    try:
        with _decoders:
            frame, info = poster(path)
    except MediaError as exc:
        return VideoCheck(str(path), str(exc), QImage())
    except Exception as exc:  # noqa: BLE001 - never leave an attachment "checking" for ever
        why = " ".join(str(exc).split()) or type(exc).__name__
        return VideoCheck(str(path), f"{Path(path).name} could not be checked ({why}).", QImage())
    h, w = frame.shape[:2]
    image = QImage(frame.tobytes(), w, h, 3 * w, QImage.Format.Format_RGB888).copy()
    return VideoCheck(
        str(path),
        None,
        _rounded_square(image, px, ratio, radius),
        info.seconds,
        sampling_note(Path(path).name, info.seconds, limits),
    )


def poster_thumbnail(path: str | Path, size: int, ratio: float = 1.0, radius: int = 8) -> QImage:
    """A sent video's poster (null when the file has gone or is unreadable)."""
    return check_video(path, size, ratio, radius).thumb


class VideoPlayer(QDialog):
    """Plays a video in the window (QtMultimedia), closed with Esc."""

    def __init__(self, path: str, parent: QWidget | None = None):
        from PySide6.QtMultimedia import QAudioOutput, QMediaPlayer
        from PySide6.QtMultimediaWidgets import QVideoWidget

        super().__init__(parent)
        self.setObjectName("videoPlayer")
        self.setWindowTitle(Path(path).name)
        self.video = QVideoWidget(self)
        self.audio = QAudioOutput(self)
        self.player = QMediaPlayer(self)
        self.player.setVideoOutput(self.video)
        self.player.setAudioOutput(self.audio)
        self.player.setSource(QUrl.fromLocalFile(str(path)))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.video)
        self.resize(720, 420)
        self.finished.connect(self.player.stop)
        self.player.play()


def play(path: str, parent: QWidget | None) -> QDialog | None:
    """Play ``path``: in a window of ours when QtMultimedia is installed, else in the
    system's player (returns None then)."""
    try:
        dialog = VideoPlayer(path, parent.window() if parent is not None else None)
    except ImportError:
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))
        return None
    from app.qt import Qt

    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.show()
    return dialog
