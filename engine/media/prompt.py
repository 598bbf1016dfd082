"""From a rendered chat prompt with media placeholders to token ids and embeddings.

The chat template writes one short placeholder per image or clip (Gemma 3:
``<start_of_image>``; Qwen2.5-VL: ``<|image_pad|>`` between its vision markers). Each
is replaced in the text by the full sequence the model's processor would write (so the
tokenizer sees exactly what transformers' processor tokenizes), then the runs of soft
tokens are located in the ids. Each such token gets a key naming the media content
and its index, so prefix reuse can tell two photos apart although their ids agree.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.api import MediaInput
from engine.errors import MediaError


@dataclass
class PreparedMedia:
    """One decoded and preprocessed item, ready for its tower (which may not be loaded)."""

    kind: str  # "image" / "audio"
    key: str  # content hash + every setting that changes the encoding
    n_tokens: int  # soft tokens it takes in the prompt
    text: str  # what replaces the template's placeholder
    data: Any  # processor output the tower reads
    grid: tuple[int, int, int] | None = None  # (t, h, w) in LM tokens, for 3-D positions
    # Several runs of soft tokens in ``text``, each encoded on its own (Gemma 3's
    # pan-and-scan: the whole image, then its crops); empty when the item is one run.
    views: list[PreparedMedia] = field(default_factory=list)
    # What the user should know about how the item was taken (a long video sampled to the
    # model's frame limit, audio cut to what the model hears); "" when nothing.
    note: str = ""
    # A follow-up turn about media seen before (engine/media/towers.py) carries no ``data``
    # but the tower's output when it is still cached, else ``again``: preparing it afresh.
    encoded: Any = None
    again: Callable[[], PreparedMedia] | None = None

    def runs(self) -> list[PreparedMedia]:
        """The runs of soft tokens this item puts in the prompt, in order, each with its own
        key and tower input."""
        return self.views or [self]


class MediaEncoder(Protocol):
    """A model's tower for one kind of media. ``prepare`` is cheap and needs no weights;
    ``encode`` loads the tower on first use."""

    kind: str
    placeholder: str  # what the chat template writes for one item
    token_id: int  # the soft token repeated n_tokens times
    loaded: bool  # whether the tower's weights are in memory
    calls: int  # tower forward passes so far

    def prepare(self, item: MediaInput) -> PreparedMedia: ...

    def encode(self, item: PreparedMedia) -> Any: ...  # mx.array (n_tokens, hidden)


@dataclass
class MediaSpan:
    start: int  # index in the prompt ids of the first soft token
    end: int  # one past the last
    item: PreparedMedia


@dataclass
class MediaPrompt:
    ids: list[int]
    keys: list[Hashable]  # ids, with media tokens replaced by (content key, index)
    spans: list[MediaSpan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the items' notes, in order


def expand_placeholders(text: str, items: list[PreparedMedia], placeholders: dict[str, str]) -> str:
    """Replace the n-th placeholder of each item's kind, in document order, by its text."""
    out: list[str] = []
    cursor = 0
    for number, item in enumerate(items, start=1):
        marker = placeholders[item.kind]
        at = text.find(marker, cursor)
        if at < 0:
            raise MediaError(
                f"The chat template left no place for {item.kind} {number} (no {marker!r} in the prompt); "
                f"this model's template may not take {item.kind}s in that message role."
            )
        out.append(text[cursor:at])
        out.append(item.text)
        cursor = at + len(marker)
    out.append(text[cursor:])
    return "".join(out)


def locate_media(ids: list[int], items: list[PreparedMedia], token_ids: dict[str, int]) -> MediaPrompt:
    """Find each item's runs of soft tokens (in order) and build the per-token keys; a
    span covers one run."""
    keys: list[Hashable] = list(ids)
    spans: list[MediaSpan] = []
    cursor = 0
    for item in (run for each in items for run in each.runs()):
        tid = token_ids[item.kind]
        try:
            start = ids.index(tid, cursor)
        except ValueError:
            start = -1
        end = start + item.n_tokens
        if start < 0 or ids[start:end] != [tid] * item.n_tokens:
            raise MediaError(
                f"The prompt does not hold the {item.n_tokens} placeholder tokens a {item.kind} needs; "
                "the tokenizer may not match this model."
            )
        spans.append(MediaSpan(start, end, item))
        for j in range(start, end):
            keys[j] = (item.key, j - start)
        cursor = end
    claimed = {j for s in spans for j in range(s.start, s.end)}
    soft = set(token_ids.values())
    stray = [j for j, t in enumerate(ids) if t in soft and j not in claimed]
    if stray:
        raise MediaError(
            "The text holds a media placeholder token with no image or audio behind it; "
            "remove it from the message or attach the media."
        )
    return MediaPrompt(ids=list(ids), keys=keys, spans=spans, notes=[i.note for i in items if i.note])
