"""Attached images, audio and video: what counts as one, where it is kept, how the engine sees it.

A sent attachment is copied into ``<data dir>/attachments/<sha256>.<ext>``: named by
its content, so the same photo attached twice is stored once, and the history never
points at a file the user may move or delete later. No Qt here.
"""

from __future__ import annotations

import hashlib
import mimetypes
import shutil
from pathlib import Path
from typing import Any

ATTACHMENTS_DIR = "attachments"
IMAGE_EXT = {
    ".png",
    ".jpg",
    ".jpeg",
    ".webp",
    ".gif",
    ".bmp",
    # Phone and camera photos: Qt cannot read these, Pillow (with pillow-heif) can.
    ".heic",
    ".heif",
    ".hif",
    ".avif",
}
# Formats that only Pillow decodes: checked by decoding when attached, and thumbnailed
# from the decoded image (the file itself is kept as it is).
PILLOW_ONLY_EXT = {".heic", ".heif", ".hif", ".avif"}
# Pasted or dragged image data in these formats is kept byte for byte.
ENCODED_IMAGE_MIME = {"image/heic": ".heic", "image/heif": ".heif", "image/avif": ".avif"}
AUDIO_EXT = {".wav", ".mp3", ".flac", ".ogg", ".m4a"}
VIDEO_EXT = {".mp4", ".mov", ".m4v", ".webm", ".mkv"}

VISION_MODELS = "a vision model such as Gemma 3 or Qwen2.5-VL"
NO_VISION = f"This model can't see images — load {VISION_MODELS}."
NO_MODEL_FOR_IMAGES = f"Load {VISION_MODELS} to attach images."
# The families whose engine towers watch video (engine.media.towers.TOWERS; a test keeps
# the two in step). Whether the loaded model is one, the app asks the engine (ModelInfo.video).
VIDEO_MODELS = (
    "a video model: Qwen3.5 / Qwen3.6, Qwen3-VL or Qwen3-VL-MoE (qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe)"
)
NO_VIDEO = f"This model can't watch video — load {VIDEO_MODELS}."
NO_MODEL_FOR_VIDEO = f"Load {VIDEO_MODELS} to attach video."
NO_WHISPER = (
    "To turn speech into text, pick a Whisper model folder under "
    "Settings → Speech to text (or load an audio model such as Qwen2-Audio)."
)

_EXTRA_MIME = {
    ".webp": "image/webp",
    ".heic": "image/heic",
    ".heif": "image/heif",
    ".hif": "image/heif",
    ".avif": "image/avif",
    ".m4a": "audio/mp4",
    ".flac": "audio/flac",
    ".ogg": "audio/ogg",
    ".mkv": "video/x-matroska",
    ".m4v": "video/x-m4v",
    ".webm": "video/webm",
}


def media_kind(path: str | Path) -> str | None:
    """ "image", "audio", "video" or None, from the file name."""
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXT:
        return "image"
    if ext in VIDEO_EXT:
        return "video"
    return "audio" if ext in AUDIO_EXT else None


def refusal(path: str | Path, vision: bool | None, video: bool | None = None) -> str | None:
    """Why ``path`` cannot be attached as it is, in one line (None: it can).

    ``vision`` is whether the loaded model sees images (None: no model loaded), ``video``
    whether it watches video (None: no model loaded, or not said). Audio is never refused
    here: it goes as audio or through transcription.
    """
    name = Path(path).name
    kind = media_kind(path)
    if kind is None:
        return (
            f"{name} is not an image, audio or video file "
            "(PNG, JPEG, WebP, HEIC, AVIF, WAV, MP3, FLAC, OGG, M4A, MP4, MOV, M4V, WebM, MKV)."
        )
    if kind == "image":
        if vision is None:
            return NO_MODEL_FOR_IMAGES
        if not vision:
            return NO_VISION
    if kind == "video":
        if vision is None or video is None:
            return NO_MODEL_FOR_VIDEO
        if not video:
            return NO_VIDEO
    return None


def mime_type(path: str | Path) -> str:
    ext = Path(path).suffix.lower()
    return _EXTRA_MIME.get(ext) or mimetypes.guess_type(f"x{ext}")[0] or ""


def attachments_dir(data_dir: str | Path) -> Path:
    folder = (Path(data_dir) / ATTACHMENTS_DIR).resolve()  # stored paths are absolute
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def keep_bytes(data_dir: str | Path, data: bytes, ext: str) -> Path:
    """Store ``data`` under its content hash; returns the stored file."""
    ext = ext.lower() if ext.startswith(".") else f".{ext.lower()}"
    target = attachments_dir(data_dir) / f"{hashlib.sha256(data).hexdigest()}{ext}"
    if not target.exists():
        partial = target.with_suffix(target.suffix + ".part")
        partial.write_bytes(data)
        partial.replace(target)  # never a half-written attachment under the final name
    return target


def keep_file(data_dir: str | Path, path: str | Path) -> Path:
    """Copy ``path`` into the attachments folder under its content hash (a file already
    there is returned as it is)."""
    source = Path(path)
    folder = attachments_dir(data_dir)
    if source.parent.resolve() == folder.resolve() and len(source.stem) == 64:
        return source
    digest = hashlib.sha256()
    with source.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    target = folder / f"{digest.hexdigest()}{source.suffix.lower()}"
    if not target.exists():
        partial = target.with_suffix(target.suffix + ".part")
        shutil.copyfile(source, partial)
        partial.replace(target)
    return target


def message_content(
    text: str, attachments: list[tuple[str, str]], kinds: set[str] | frozenset[str]
) -> str | list[dict[str, Any]]:
    """A message's content for the engine: plain text, or the media parts the model can
    take (in order) followed by the text, as in transformers' multimodal chat format."""
    parts: list[dict[str, Any]] = [{"type": kind, kind: path} for kind, path in attachments if kind in kinds]
    if not parts:
        return text
    return [*parts, {"type": "text", "text": text}]
