"""Readable text out of HTML and XHTML, by the standard library's HTML parser.

Nothing in the page runs: ``script``, ``style``, ``template``, ``noscript``, ``svg`` and
friends are dropped with everything inside them, and attributes (``onload=``, ``href=
"javascript:``) are never read. Headings start sections, so chunks keep the heading they
sit under; block elements end paragraphs.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

from engine.documents.model import Section

_DROPPED = {"script", "style", "template", "noscript", "svg", "math", "iframe", "object", "head", "canvas"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_BLOCKS = {
    "p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "pre", "blockquote",
    "dt", "dd", "dl", "hr", "figure", "figcaption", "header", "footer", "nav", "aside", "title",
}  # fmt: skip
_VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = []
        self._heading: str | None = None
        self._parts: list[str] = []
        self._dropped_depth = 0
        self._in_heading: list[str] | None = None
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _DROPPED:
            if tag not in _VOID:
                self._dropped_depth += 1
            return
        if self._dropped_depth:
            return
        if tag in _HEADINGS:
            self._flush()
            self._in_heading = []
        elif tag in _BLOCKS:
            self._parts.append("\n\n" if tag not in {"br", "li", "tr", "dt", "dd"} else "\n")
        if tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROPPED:
            self._dropped_depth = max(0, self._dropped_depth - 1)
            return
        if self._dropped_depth:
            return
        if tag in _HEADINGS and self._in_heading is not None:
            self._heading = _squash(" ".join(self._in_heading)) or self._heading
            self._in_heading = None
        elif tag in _BLOCKS:
            self._parts.append("\n\n")
        if tag == "pre":
            self._pre = max(0, self._pre - 1)

    def handle_data(self, data: str) -> None:
        if self._dropped_depth:
            return
        if self._in_heading is not None:
            self._in_heading.append(data)
        else:
            self._parts.append(data if self._pre else re.sub(r"[ \t\r\n]+", " ", data))

    def _flush(self) -> None:
        text = _tidy("".join(self._parts))
        if text:
            self.sections.append(Section(text=text, heading=self._heading))
        self._parts = []

    def finish(self) -> list[Section]:
        self.close()
        if self._in_heading is not None:
            self._heading = _squash(" ".join(self._in_heading)) or self._heading
        self._flush()
        return self.sections


def html_sections(markup: str) -> list[Section]:
    """The page's text as sections, one per heading (the text before the first has none)."""
    reader = _Reader()
    reader.feed(markup)
    return reader.finish()


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _tidy(text: str) -> str:
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
