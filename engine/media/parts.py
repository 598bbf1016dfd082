"""Media parts of chat messages: where each image or audio clip sits, and what it is.

Messages follow transformers' multimodal chat format: ``content`` is a string or a list
of parts, ``{"type": "text", "text": ...}``, ``{"type": "image"}``, ``{"type": "audio"}``,
``{"type": "video"}``.
A media part may carry its own source (``"image": PATH``, ``"path"``, ``"url"`` with a
``file://`` address, or the encoded bytes); one without takes the next attached
``MediaInput`` of its kind. An image part may say ``"pan_and_scan": true/false``
(Gemma 3's crops of wide or tall images) for that image alone. The templates only need the part's type, so the messages
handed on keep ``{"type": kind}`` and the text parts. No MLX here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.api import MediaInput
from engine.errors import MediaError

MEDIA_KINDS = ("image", "audio", "video")
# Keys a part may hold its source under, per kind (transformers' spellings included).
_SOURCE_KEYS = {
    "image": ("image", "path", "url", "image_url"),
    "audio": ("audio", "path", "url", "audio_url"),
    "video": ("video", "path", "url", "video_url"),
}
_ALIASES = {
    "image_url": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "input_video": "video",
}


def part_kind(part: Any) -> str | None:
    """ "image" / "audio" / "video" for a media part, None for text and anything else."""
    if not isinstance(part, Mapping):
        return None
    kind = _ALIASES.get(str(part.get("type")), part.get("type"))
    return kind if kind in MEDIA_KINDS else None


def _source(part: Mapping[str, Any], kind: str) -> str | bytes | None:
    for key in _SOURCE_KEYS[kind]:
        value = part.get(key)
        if isinstance(value, Mapping):  # OpenAI style: {"image_url": {"url": ...}}
            value = value.get("url") or value.get("path")
        if value is None or value == "":
            continue
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, str):
            if value.startswith("file://"):
                return value[len("file://") :]
            if value.startswith(("http://", "https://", "data:")):
                raise MediaError(
                    f"The {kind} {value[:60]!r} is a web address; attach a local file instead "
                    "(the engine never downloads media)."
                )
            return value
        raise MediaError(f"A {kind} part holds a {type(value).__name__}; give a file path or the file's bytes.")
    return None


def split_media(
    messages: Sequence[Mapping[str, Any]], media: Sequence[MediaInput] = ()
) -> tuple[list[dict[str, Any]], list[MediaInput]]:
    """(messages for the template, the media in the order their parts appear).

    Raises MediaError when parts and attachments do not pair up.
    """
    queues: dict[str, list[MediaInput]] = {k: [m for m in media if m.kind == k] for k in MEDIA_KINDS}
    for item in media:
        if item.kind not in MEDIA_KINDS:
            raise MediaError(f"Unknown media kind {item.kind!r}; attach images, audio or video.")
    used = {k: 0 for k in MEDIA_KINDS}
    ordered: list[MediaInput] = []
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[Any] = []
        for part in content:
            kind = part_kind(part)
            if kind is None:
                parts.append(part)
                continue
            source = _source(part, kind)
            if source is None:
                if used[kind] >= len(queues[kind]):
                    raise MediaError(
                        f"A message has more {kind} parts than {kind}s attached ({len(queues[kind])}); "
                        f"attach one {kind} per part, or give the part its file."
                    )
                item = queues[kind][used[kind]]
                used[kind] += 1
            else:
                item = MediaInput(kind, source)  # type: ignore[arg-type]
            if isinstance(part.get("pan_and_scan"), bool):  # the part's own word wins
                item = replace(item, pan_and_scan=part["pan_and_scan"])
            ordered.append(item)
            parts.append({"type": kind})
        out.append({**message, "content": parts})
    for kind in MEDIA_KINDS:
        left = len(queues[kind]) - used[kind]
        if left:
            raise MediaError(
                f'{left} attached {kind}(s) have no {{"type": "{kind}"}} part in the messages; '
                f"add a part where each {kind} belongs."
            )
    return out, ordered


def media_kinds(messages: Sequence[Mapping[str, Any]], media: Sequence[MediaInput] = ()) -> set[str]:
    """The kinds of media a request carries (parts in messages, plus attachments)."""
    kinds = {m.kind for m in media}
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            kinds.update(k for k in (part_kind(p) for p in content) if k)
    return kinds


def user_message(text: str, media: Sequence[MediaInput]) -> dict[str, Any]:
    """One user message: the media in the order given, then the text (the CLI's --chat form)."""
    if not media:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": m.kind} for m in media]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}
