"""Chunks by structure: never across a page or a heading, paragraphs kept whole, with overlap.

A section (a PDF page, or the text under one heading) is cut at paragraph breaks into
pieces of about ``target`` characters; a paragraph longer than that is cut at sentence
ends, then at spaces. Each chunk after the first of its section starts with the last
``overlap`` characters' worth of whole sentences of the one before, so a fact that
straddles a cut is whole in one of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.documents.model import Document

TARGET_CHARS = 1200
OVERLAP_CHARS = 200


@dataclass
class Chunk:
    text: str
    page: int | None
    heading: str | None
    ordinal: int  # its place in the document, from 0


def chunk_document(doc: Document, target: int = TARGET_CHARS, overlap: int = OVERLAP_CHARS) -> list[Chunk]:
    chunks: list[Chunk] = []
    for section in doc.sections:
        for text in split_text(section.text, target, overlap):
            chunks.append(Chunk(text=text, page=section.page, heading=section.heading, ordinal=len(chunks)))
    return chunks


def split_text(text: str, target: int = TARGET_CHARS, overlap: int = OVERLAP_CHARS) -> list[str]:
    pieces = [p for para in re.split(r"\n\s*\n", text) for p in _fit(para.strip(), target) if p]
    out: list[str] = []
    current: list[str] = []
    size = 0
    for piece in pieces:
        if current and size + len(piece) > target:
            out.append("\n\n".join(current))
            tail = _tail(out[-1], overlap)
            current, size = ([tail] if tail else []), len(tail)
        current.append(piece)
        size += len(piece) + 2
    if current and (not out or "\n\n".join(current) != _tail(out[-1], overlap)):
        out.append("\n\n".join(current))
    return out


def _fit(paragraph: str, target: int) -> list[str]:
    """A paragraph as pieces no longer than ``target``: whole sentences, else cut at spaces."""
    if len(paragraph) <= target:
        return [paragraph]
    out: list[str] = []
    current = ""
    for sentence in re.split(r"(?<=[.!?])\s+", paragraph):
        while len(sentence) > target:
            cut = sentence.rfind(" ", 0, target)
            cut = cut if cut > target // 2 else target
            if current:
                out.append(current)
                current = ""
            out.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if current and len(current) + 1 + len(sentence) > target:
            out.append(current)
            current = sentence
        else:
            current = f"{current} {sentence}".strip()
    if current:
        out.append(current)
    return out


def _tail(text: str, overlap: int) -> str:
    """The last whole sentences of ``text`` within ``overlap`` characters (maybe none)."""
    if overlap <= 0:
        return ""
    sentences = re.split(r"(?<=[.!?])\s+", text[-(overlap * 2) :])
    tail = ""
    for sentence in reversed(sentences[1:]):
        if len(tail) + len(sentence) + 1 > overlap:
            break
        tail = f"{sentence} {tail}".strip()
    return tail
