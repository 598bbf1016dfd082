"""Reading video files with PyAV (FFmpeg): the clip's frame count and rate, and the
frames at chosen numbers, decoded in order as transformers' PyAV loader does (every
frame up to the last one wanted is decoded; the wanted ones are kept as RGB), or, for
a clip sampled sparsely over a long duration, by seeking to each wanted frame (from
the keyframe before it), so a 3-hour video costs about the frames sampled. In order,
where each packet is plainly one frame (no B-frames), the packets that no wanted frame
needs (those after the last wanted one of a keyframe interval) are not decoded at all:
each run decoded starts at a keyframe, so its pictures are those of decoding everything.

Decoding uses FFmpeg's frame threads (several pictures at once; its threaded decoding
gives the same pictures as one thread), and ``convert_frames`` hands each wanted frame
to a pool of threads (conversion to RGB, and the caller's resizing and normalising, all
release the GIL) while the next ones decode.

Every failure is a MediaError with one line: not a video, no video stream, corrupt.
"""

from __future__ import annotations

import io
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import MediaError

# A container that does not give the frame count has its packets counted (exact, as
# reading the file through) up to this length; past it the count comes from the duration.
COUNT_PACKETS_UP_TO_S = 20 * 60

# Past this many frames ahead, the next wanted frame is reached by seeking (to the keyframe
# before it) rather than by decoding on: x264's default keyframe interval, so a seek
# usually lands nearer the frame than the decoder already is.
SEEK_GAP_FRAMES = 250

# How far past the last wanted frame packet times are checked for B-frames: H.264 and HEVC
# reorder at most 16 pictures.
REORDER_WINDOW = 16

# Threads that convert (and the caller's work on) decoded frames; frames waiting for one
# are held to a few per thread, so a fast decoder does not pile up a clip's pictures.
MAX_WORKERS = 8


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
        seconds = float(container.duration or 0) / 1_000_000
        if frames <= 0 and fps > 0 and seconds > COUNT_PACKETS_UP_TO_S:  # a long clip: its length, not a read
            frames = round(seconds * fps)
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
    return info


def duration_text(seconds: float) -> str:
    """``1 h 05 min`` / ``4 min 09 s``: a clip's length as the notes say it."""
    s = round(seconds)
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"


def read_frames(source: str | Path | bytes, indices: Sequence[int], *, seek: bool = False) -> np.ndarray:
    """The frames numbered ``indices`` (ascending), uint8 (n, H, W, 3) RGB. Decoded in
    order from the start, or with ``seek`` by seeking to each one (for frames far apart:
    the cost is then a keyframe interval per frame, not the whole clip)."""
    with closing(decoded_frames(source, indices, seek=seek)) as frames:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in frames])


def convert_frames(
    source: str | Path | bytes,
    indices: Sequence[int],
    work: Callable[[int, np.ndarray], object],
    *,
    seek: bool = False,
) -> int:
    """Decode the frames numbered ``indices`` (as ``read_frames``) and call ``work(k, rgb)``
    for the k-th of them (uint8 (H, W, 3) RGB) on a pool of threads, while the next ones
    decode. Returns how many frames there were; an error in ``work`` is raised here."""
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    pending: deque[Future] = deque()
    count = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="video-frames") as pool:
        with closing(decoded_frames(source, indices, seek=seek)) as frames:
            for count, frame in enumerate(frames, 1):
                pending.append(pool.submit(_convert, work, count - 1, frame))
                while len(pending) > 2 * workers:
                    pending.popleft().result()
        while pending:
            pending.popleft().result()
    return count


def _convert(work: Callable[[int, np.ndarray], object], k: int, frame) -> None:
    work(k, frame.to_ndarray(format="rgb24"))


def decoded_frames(source: str | Path | bytes, indices: Sequence[int], *, seek: bool = False) -> Iterator:
    """The frames numbered ``indices`` as PyAV frames (not yet converted), in order. A clip
    that breaks off after some of them gives those; one that gives none is a MediaError."""
    name = _name(source)
    wanted = sorted({int(i) for i in indices})
    container = _open(source)
    count = 0
    try:
        stream = _stream(container, name)
        # Frame threads: the same pictures as one thread gives, several decoded at once.
        stream.thread_type = "AUTO"
        if seek:
            frames = _seek_frames(container, stream, wanted)
        else:
            plan = _packet_plan(source, wanted)
            frames = (
                _decode_frames(container, stream, wanted) if plan is None else _decode_planned(container, stream, *plan)
            )
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                break
            except _errors() as e:
                if count:
                    break
                raise MediaError(f"Video {name} is corrupt or truncated ({_reason(e)}).") from None
            count += 1
            yield frame
    finally:
        container.close()
    if not count:
        raise MediaError(f"Video {name} has no frames that can be decoded.")


def _decode_frames(container, stream, wanted: list[int]) -> Iterator:
    """Every frame up to the last wanted one, in order (transformers' PyAV loader)."""
    keep, last = set(wanted), wanted[-1]
    for i, frame in enumerate(container.decode(stream)):
        if i > last:
            break
        if i in keep:
            yield frame


def _packet_plan(source: str | Path | bytes, wanted: list[int]) -> tuple[set[int], set[int]] | None:
    """Which packets the wanted frames need (numbered in file order): each wanted frame's,
    and those from the keyframe before it; and the wanted frames' times. None unless frame
    i is plainly packet i: every packet timed, times rising (no B-frames, so nothing is
    reordered) up to the last wanted frame and a reorder window past it, the first a
    keyframe. Then a packet after the last wanted frame of a keyframe interval need not be
    decoded at all. Only the packets up to there are read (a poster reads one or so)."""
    container = _open(source)
    times: list[int] = []
    keyframes: list[bool] = []
    try:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            if not packet.size:
                continue
            if packet.pts is None or packet.is_discard or packet.is_corrupt or (times and packet.pts <= times[-1]):
                return None
            times.append(packet.pts)
            keyframes.append(packet.is_keyframe)
            if len(times) > wanted[-1] + REORDER_WINDOW:
                break
        if not times or not keyframes[0]:
            return None
    except _errors():
        return None
    finally:
        container.close()
    need: set[int] = set()
    keyframe = 0
    targets = set(wanted)
    for i in range(min(wanted[-1] + 1, len(times))):
        keyframe = i if keyframes[i] else keyframe
        if i in targets:
            need.update(range(keyframe, i + 1))
    if not need:  # every wanted frame past the packets: let the plain decode say so
        return None
    return need, {times[i] for i in wanted if i < len(times)}


def _decode_planned(container, stream, need: set[int], times: set[int]) -> Iterator:
    """The frames at ``times``, decoding only the packets in ``need`` (see _packet_plan):
    the pictures are those of decoding every packet, as each decoded run starts at a keyframe."""
    decoder = stream.codec_context
    last, i = max(need), -1
    for packet in container.demux(stream):
        if not packet.size:
            continue
        i += 1
        if i in need:
            yield from (f for f in decoder.decode(packet) if f.pts in times)
        if i >= last:
            break
    yield from (f for f in decoder.decode(None) if f.pts in times)


def _seek_frames(container, stream, wanted: list[int]) -> Iterator:
    """Each wanted frame by its time (frame n of a clip at r frames a second starts at
    n / r s): one far ahead is reached by seeking to the keyframe before it, one near by
    decoding on; either way decoding stops at the first frame at its time."""
    fps = float(stream.average_rate or 0)
    base = stream.time_base
    if not fps or base is None:
        yield from _decode_frames(container, stream, wanted)
        return
    start = int(stream.start_time or 0)
    half = 0.5 / fps / base  # pts rounding in the container: within half a frame is the frame
    decoded, position = None, None  # the decoder, and the number of the next frame it gives
    for n in wanted:
        target = start + int(round(n / fps / base))
        if decoded is None or position is None or n - position > SEEK_GAP_FRAMES:
            container.seek(target, stream=stream, backward=True)
            decoded = container.decode(stream)
        chosen = None
        for frame in decoded:
            if frame.pts is not None and frame.pts >= target - half:
                chosen = frame
                break
        if chosen is None:  # past the end (a header longer than the stream): the rest too
            break
        position = n + 1
        yield chosen


def poster(source: str | Path | bytes) -> tuple[np.ndarray, VideoInfo]:
    """The first frame (uint8 (H, W, 3) RGB) and the clip's facts, for a thumbnail; the
    same one-line MediaErrors as ``probe`` (a clip too long to sample is refused here too)."""
    info = probe(source)
    return read_frames(source, [0])[0], info
