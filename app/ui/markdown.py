"""Message text to display pieces: Markdown prose and highlighted code blocks.

Prose is Markdown rendered by Qt's own parser (GitHub dialect) with raw HTML turned
off, and a single newline kept as a line break (as chat apps show text, not as Markdown
joins lines): whatever a model or a user writes (``std::vector<int>``, ``<s>``, ``<div>``,
``<span style=...>``) is shown as the characters it is, never obeyed. Only http(s)
links stay links. Fenced code blocks are cut out so each can get its own frame, a
copy button and syntax colours (Pygments when installed, plain monospace otherwise).

A long unbroken run (a 600-character word, a long URL, base64) gets zero-width break
opportunities so it wraps inside its block instead of widening the whole column.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from functools import lru_cache

from app.qt import QTextCharFormat, QTextCursor, QTextDocument, QUrl

FENCE = re.compile(r"^(```|~~~)[ \t]*([\w+#.-]*)[^\n]*\n", re.MULTILINE)


@dataclass
class Block:
    kind: str  # "prose" | "code"
    text: str
    language: str = ""
    closed: bool = True  # False for a code block still streaming in


def split_blocks(text: str) -> list[Block]:
    """Cut text at fenced code blocks. An unclosed fence runs to the end (streaming)."""
    blocks: list[Block] = []
    pos = 0
    while True:
        m = FENCE.search(text, pos)
        if m is None:
            break
        if m.start() > pos:
            blocks.append(Block("prose", text[pos : m.start()]))
        fence, lang = m.group(1), m.group(2)
        close = re.compile(rf"^{re.escape(fence)}[ \t]*$", re.MULTILINE).search(text, m.end())
        if close is None:
            blocks.append(Block("code", text[m.end() :].rstrip("\n"), lang, closed=False))
            return blocks
        blocks.append(Block("code", text[m.end() : close.start()].rstrip("\n"), lang))
        pos = close.end() + 1
    if pos < len(text):
        blocks.append(Block("prose", text[pos:]))
    return [b for b in blocks if b.kind == "code" or b.text.strip()]


# Rendering is a pure function of the text, and the same messages are rendered again each
# time a chat is opened or scrolled back into view: the last few hundred renderings are kept
# (a bounded number, so memory stays flat however long the chats).
RENDER_CACHE = 256


@lru_cache(maxsize=RENDER_CACHE)
def highlight_html(code: str, language: str, dark: bool) -> str:
    """Code as coloured HTML for a QLabel/QTextBrowser (a <pre> block)."""
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name, guess_lexer
        from pygments.util import ClassNotFound
    except ImportError:
        return f"<pre>{html.escape(code)}</pre>"
    try:
        lexer = get_lexer_by_name(language) if language else guess_lexer(code)
    except ClassNotFound:
        return f"<pre>{html.escape(code)}</pre>"
    style = "monokai" if dark else "friendly"
    # noclasses: Qt's rich text understands inline styles, not a style sheet's classes.
    formatter = HtmlFormatter(style=style, noclasses=True, nobackground=True, nowrap=True)
    return f"<pre>{highlight(code, lexer, formatter)}</pre>"


LINK_SCHEMES = ("http", "https")
BREAK = "\u200b"  # zero-width space: a line-break opportunity that shows nothing
BREAK_EVERY = 24  # characters between breaks inside a long unbroken run
_LONG_RUN = re.compile(rf"[^\s{BREAK}]{{{BREAK_EVERY + 1},}}")


def is_live_link(url: str) -> bool:
    """Only web addresses open (in the browser); file:, javascript:, data: ... never."""
    return QUrl(url).scheme().lower() in LINK_SCHEMES


def breakable(text: str) -> str:
    """Plain text with a break opportunity every BREAK_EVERY characters of a long run."""

    def cut(m: re.Match[str]) -> str:
        run = m.group(0)
        return BREAK.join(run[i : i + BREAK_EVERY] for i in range(0, len(run), BREAK_EVERY))

    return _LONG_RUN.sub(cut, text)


# A line ending in text, followed by another line: Markdown would join the two with a space.
_SOFT_BREAK = re.compile(r"(?<=[^\s\\])[ \t]?\n(?=[^\n])")


def keep_line_breaks(text: str) -> str:
    """Make each single newline a line break (two trailing spaces), as chat apps show text:
    a poem's or a story's lines stay lines. Blank lines still part paragraphs."""
    return _SOFT_BREAK.sub("  \n", text)


def prose_document(text: str) -> QTextDocument:
    """Markdown as a QTextDocument: single newlines kept as line breaks, raw HTML shown as
    text, only http(s) links live, long runs breakable (the breaks go into the text, never
    into a link's address)."""
    doc = QTextDocument()
    features = QTextDocument.MarkdownFeature
    doc.setMarkdown(keep_line_breaks(text), features.MarkdownDialectGitHub | features.MarkdownNoHTML)
    _unlink_unsafe(doc)
    _break_long_runs(doc)
    return doc


@lru_cache(maxsize=RENDER_CACHE)
def prose_html(text: str) -> str:
    """Markdown prose as rich text for a QLabel (its own fonts and colours apply)."""
    out = prose_document(text).toHtml()
    # The document's default font would override the label's style sheet.
    return re.sub(r'<body style="[^"]*">', "<body>", out, count=1)


def _fragments(doc: QTextDocument):
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            yield it.fragment()
            it += 1
        block = block.next()


def _unlink_unsafe(doc: QTextDocument) -> None:
    unsafe = [
        (f.position(), f.length())
        for f in _fragments(doc)
        if f.charFormat().isAnchor() and not is_live_link(f.charFormat().anchorHref())
    ]
    for position, length in unsafe:
        cursor = QTextCursor(doc)
        cursor.setPosition(position)
        cursor.setPosition(position + length, QTextCursor.MoveMode.KeepAnchor)
        plain = QTextCharFormat()
        plain.setAnchor(False)
        plain.setAnchorHref("")
        plain.setForeground(cursor.charFormat().foreground())
        cursor.mergeCharFormat(plain)
        fmt = cursor.charFormat()
        fmt.clearProperty(QTextCharFormat.Property.AnchorHref)
        fmt.clearProperty(QTextCharFormat.Property.IsAnchor)
        fmt.clearForeground()
        fmt.setFontUnderline(False)
        cursor.setCharFormat(fmt)


def _break_long_runs(doc: QTextDocument) -> None:
    text = doc.toPlainText()
    # Insert from the end so earlier positions stay valid.
    for m in reversed(list(_LONG_RUN.finditer(text))):
        for offset in reversed(range(BREAK_EVERY, m.end() - m.start(), BREAK_EVERY)):
            cursor = QTextCursor(doc)
            cursor.setPosition(m.start() + offset)
            cursor.insertText(BREAK)
