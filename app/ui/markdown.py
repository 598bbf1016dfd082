"""Message text to display pieces: Markdown prose and highlighted code blocks.

Prose is left as Markdown for QLabel's own renderer (Qt's CommonMark). Fenced
code blocks are cut out so each can get its own frame, a copy button and
syntax colours (Pygments when installed, plain monospace otherwise).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

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
            blocks.append(Block("prose", text[pos:m.start()]))
        fence, lang = m.group(1), m.group(2)
        close = re.compile(rf"^{re.escape(fence)}[ \t]*$", re.MULTILINE).search(text, m.end())
        if close is None:
            blocks.append(Block("code", text[m.end():].rstrip("\n"), lang, closed=False))
            return blocks
        blocks.append(Block("code", text[m.end():close.start()].rstrip("\n"), lang))
        pos = close.end() + 1
    if pos < len(text):
        blocks.append(Block("prose", text[pos:]))
    return [b for b in blocks if b.kind == "code" or b.text.strip()]


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
