"""Reading video files with PyAV (FFmpeg): the clip's frame count and rate, and the
frames at chosen numbers, decoded in order as transformers' PyAV loader does (every
frame up to the last one wanted is decoded; the wanted ones are kept as RGB).

Every failure is a MediaError with one line: not a video, no video stream, corrupt,
or longer than ``MAX_SECONDS``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import MediaError

# Frames are decoded in order up to the last sampled one; past this length that takes
# minutes, so longer clips are refused with a note to trim them.
MAX_SECONDS = 20 * 60


@dataclass
class VideoInfo:
    frames: int  # as the container reports it
    fps: float  # the stream's average frame rate
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps else 0.0


def _name(source: str | Path | bytes) -> str:
    return "data" if isinstance(source, (bytes, bytearray, memoryview)) else Path(source).name


def _av():
    try:
        import av
    except ImportError:  # pragma: no cover - av is a dependency
        raise MediaError("Video needs PyAV (the av package); reinstall MLX Desk.") from None
    return av


def _errors() -> tuple[type[BaseException], ...]:
    """What FFmpeg raises on bad data (its own errors, and PyAV's on odd streams)."""
    return (_av().FFmpegError, OSError, ValueError, EOFError, RuntimeError)


def _open(source: str | Path | bytes):
    av = _av()
    name = _name(source)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        path = Path(source)
        if not path.is_file():
            raise MediaError(f"Video file not found: {path}")
        if path.stat().st_size == 0:
            raise MediaError(f"Video {name} is empty (0 bytes).")
    try:
        handle = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else str(source)
        return av.open(handle)
    except _errors() as e:
        raise MediaError(f"{name} is not a video that can be read ({_reason(e)}).") from None


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _stream(container, name: str):
    if not container.streams.video:
        container.close()
        raise MediaError(f"{name} holds no video stream (is it an audio file?); attach a video.")
    return container.streams.video[0]


def probe(source: str | Path | bytes) -> VideoInfo:
    """The clip's frame count, rate and size, without decoding frames."""
    name = _name(source)
    container = _open(source)
    try:
        stream = _stream(container, name)
        frames = int(stream.frames or 0)
        fps = float(stream.average_rate or 0)
        if frames <= 0 or fps <= 0:  # some containers do not say: count the packets
            frames = sum(1 for p in container.demux(stream) if p.size)
            seconds = float(container.duration or 0) / 1_000_000
            fps = fps or (frames / seconds if seconds else 0.0)
        info = VideoInfo(frames, fps, int(stream.width or 0), int(stream.height or 0))
    except _errors() as e:
        raise MediaError(f"Video {name} is corrupt or truncated ({_reason(e)}).") from None
    finally:
        container.close()
    if info.frames <= 0 or info.fps <= 0 or info.width <= 0 or info.height <= 0:
        raise MediaError(f"Video {name} has no frames that can be decoded.")
    if info.seconds > MAX_SECONDS:
        raise MediaError(
            f"Video {name} is {_duration(info.seconds)} long; the longest this app samples is "
            f"{_duration(MAX_SECONDS)}. Trim it first."
        )
    return info


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"


def read_frames(source: str | Path | bytes, indices: Sequence[int]) -> np.ndarray:
    """The frames numbered ``indices`` (ascending), uint8 (n, H, W, 3) RGB."""
    name = _name(source)
    wanted = {int(i) for i in indices}
    last = max(wanted)
    container = _open(source)
    frames = []
    try:
        _stream(container, name)
        for i, frame in enumerate(container.decode(video=0)):
            if i > last:
                break
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
    except _errors() as e:
        if not frames:
            raise MediaError(f"Video {name} is corrupt or truncated ({_reason(e)}).") from None
    finally:
        container.close()
    if not frames:
        raise MediaError(f"Video {name} has no frames that can be decoded.")
    return np.stack(frames)


def poster(source: str | Path | bytes) -> tuple[np.ndarray, VideoInfo]:
    """The first frame (uint8 (H, W, 3) RGB) and the clip's facts, for a thumbnail; the
    same one-line MediaErrors as ``probe`` (a clip too long to sample is refused here too)."""
    info = probe(source)
    return read_frames(source, [0])[0], info
