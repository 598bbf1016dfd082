"""The two channels a reply streams on, shared by the reasoning splitters."""

from __future__ import annotations

from typing import Literal

Channel = Literal["reasoning", "answer"]


def add_piece(out: list[tuple[Channel, str]], channel: Channel, text: str) -> None:
    """Append ``text`` to ``out``, joining it to the last pair when that is the same channel."""
    if not text:
        return
    if out and out[-1][0] == channel:
        out[-1] = (channel, out[-1][1] + text)
    else:
        out.append((channel, text))
