"""A conversation's thread as the engine reads it and as the transcript marks it.

``engine_messages`` turns stored messages into the engine's (attachments as media parts by
their stored paths, tool rounds as the template writes them); ``context_start`` finds where
the model's memory begins after a context overflow left messages out; ``title_from`` names a
new chat after its first message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from app.attachments import message_content
from app.controllers import tool_turns
from app.store import Message
from engine import api


def engine_messages(history: list[Message], info: api.ModelInfo) -> tuple[list[dict[str, Any]], list[str]]:
    """The thread as the engine reads it: attachments become media parts (by their stored
    paths, so the engine's content-keyed caches recognise them on every turn). Media
    the model cannot take is left out rather than failing the reply, with a note for the
    status bar (the lines returned beside the messages)."""
    notes: list[str] = []
    kinds = {k for k, ok in (("image", info.vision), ("audio", info.audio), ("video", info.video)) if ok}
    skipped = {kind for m in history for kind, _ in m.attachments if kind not in kinds}
    if skipped:
        what = " and ".join(sorted("audio" if k == "audio" else f"{k}s" for k in skipped))
        notes.append(f"Earlier {what} in this chat are left out: {info.name} cannot take them.")
    # Files gone from the attachments folder (deleted, moved, a restored backup without
    # them): those messages go as their text, so one lost photo does not fail every turn.
    gone = {path for m in history for kind, path in m.attachments if kind in kinds and not os.path.exists(path)}
    if gone:
        notes.append(
            f"{len(gone)} earlier attachment{'s' if len(gone) > 1 else ''} of this chat "
            "are no longer on disk (the attachments folder was moved or deleted): the model "
            "reads those messages without them.",
        )
    as_text = info.tool_arguments_as_text
    out: list[dict[str, Any]] = []
    for m in history:
        if m.role == "assistant" and m.tool_turns:  # its calls and results as the template writes them
            out += tool_turns.engine_messages(m.content, m.tool_turns, as_text)
        else:
            kept = [(kind, path) for kind, path in m.attachments if path not in gone]
            out.append({"role": m.role, "content": message_content(m.content, kept, kinds)})
    return out, notes


def context_start(thread: list[Message], offset: int, kept: list[int] | None, reply: int | None) -> int | None:
    """The id of the first message of ``thread`` the model still read after those it left out
    (``kept``: the request's message indices the model still reads; the thread's messages
    start at ``offset`` in the request, after a system prompt); the ``reply``'s when it
    reads none of them (a rolling window that slid past them during the reply). None when
    nothing was left out."""
    if kept is None:
        return None
    held = set(kept)
    gap = next((i for i in range(offset, offset + len(thread)) if i not in held), None)
    if gap is None:
        return None
    after = next((i for i in kept if i > gap), None)
    if after is None or after >= offset + len(thread):
        return reply
    return thread[after - offset].id


def title_from(text: str, attachments: Sequence[tuple[str, str]] = ()) -> str:
    if not text.strip() and attachments:
        kind = attachments[0][0]
        return "Image" if kind == "image" else "Voice message"
    line = text.strip().splitlines()[0] if text.strip() else "New chat"
    return line if len(line) <= 48 else line[:47].rstrip() + "…"
