"""What extraction yields: a document as sections (a PDF page, or the text under a heading)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Section:
    text: str
    page: int | None = None  # 1-based, for formats with pages
    heading: str | None = None  # the heading the text sits under, where the format has them


@dataclass
class Document:
    path: str
    kind: str  # "pdf", "html", "docx", "epub", "markdown", "text", "code"
    sections: list[Section]
    pages: int = 0  # the page count for PDFs; sections otherwise
    notes: list[str] = field(default_factory=list)  # one line each: "page 3 has no text layer"

    @property
    def text(self) -> str:
        return "\n\n".join(s.text for s in self.sections)
