"""Text out of a document file, as sections with page numbers or headings.

``extract(path)`` checks the file against the limits first (limits.py), then reads it by
its extension: PDF with pypdfium2 (PDFium, the engine Chrome uses), HTML with the
standard parser (html_text.py), DOCX and EPUB as zip archives whose members are read with
byte and ratio caps, Markdown split at its headings, text and code as they are. A PDF page
without a text layer (a scan) is a note on the document; a PDF with none at all, an
encrypted PDF, a damaged archive or a binary file named ``.txt`` is a ``DocumentError``.
"""

from __future__ import annotations

import posixpath
import re
import zipfile
from pathlib import Path
from xml.etree import ElementTree

from engine.documents.html_text import html_sections
from engine.documents.limits import (
    CODE_EXT,
    DEFAULT_LIMITS,
    DOCX_EXT,
    EPUB_EXT,
    HTML_EXT,
    MARKDOWN_EXT,
    PDF_EXT,
    DocumentError,
    DocumentLimits,
    check_file,
)
from engine.documents.model import Document, Section

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"


def extract(path: str | Path, limits: DocumentLimits = DEFAULT_LIMITS) -> Document:
    p = Path(path)
    check_file(p, limits)
    ext = p.suffix.lower()
    if ext in PDF_EXT:
        doc = _pdf(p, limits)
    elif ext in HTML_EXT:
        doc = Document(str(p), "html", html_sections(_read_text(p)))
    elif ext in DOCX_EXT:
        doc = Document(str(p), "docx", _docx(p, limits))
    elif ext in EPUB_EXT:
        doc = Document(str(p), "epub", _epub(p, limits))
    elif ext in MARKDOWN_EXT:
        doc = Document(str(p), "markdown", markdown_sections(_read_text(p)))
    else:
        kind = "code" if ext in CODE_EXT else "text"
        text = _read_text(p).strip()
        doc = Document(str(p), kind, [Section(text=text)] if text else [])
    if not doc.sections:
        raise DocumentError(f"{p.name}: no text in it to read.")
    if not doc.pages:
        doc.pages = len(doc.sections)
    return doc


def _pdf(p: Path, limits: DocumentLimits) -> Document:
    import pypdfium2 as pdfium  # a native library; loaded when a PDF is first read

    try:
        pdf = pdfium.PdfDocument(str(p))
    except pdfium.PdfiumError as exc:
        if "password" in str(exc).lower():
            raise DocumentError(f"{p.name}: the PDF is encrypted; save an unlocked copy and drop that.") from None
        raise DocumentError(f"{p.name}: not a PDF that can be read ({exc}).") from None
    try:
        n = len(pdf)
        if n > limits.max_pages:
            raise DocumentError(f"{p.name}: {n:,} pages is over the {limits.max_pages:,}-page limit; split the PDF.")
        sections, notes = [], []
        for i in range(n):
            page = pdf[i]
            textpage = page.get_textpage()
            text = textpage.get_text_range().replace("\r\n", "\n").replace("\r", "\n").strip()
            textpage.close()
            page.close()
            if text:
                sections.append(Section(text=text, page=i + 1))
            else:
                notes.append(f"page {i + 1} has no text layer")
    finally:
        pdf.close()
    if not sections:
        raise DocumentError(f"{p.name}: no page has a text layer (a scan?); run OCR on it first.")
    if len(notes) > 5:
        notes = [f"{len(notes)} pages have no text layer ({', '.join(n.split()[1] for n in notes[:5])}, ...)"]
    return Document(str(p), "pdf", sections, pages=n, notes=notes)


def _read_text(p: Path) -> str:
    data = p.read_bytes()
    if b"\x00" in data[:8192] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DocumentError(f"{p.name}: binary data, not text; drop the document it belongs to.")
    for encoding in ("utf-8-sig", "utf-16") if data.startswith((b"\xff\xfe", b"\xfe\xff")) else ("utf-8-sig",):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            pass
    return data.decode("latin-1")


def markdown_sections(text: str) -> list[Section]:
    """Markdown split at ATX headings (``#``..``######``) outside fenced code."""
    sections: list[Section] = []
    heading: str | None = None
    lines: list[str] = []
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            body = "\n".join(lines).strip()
            if body:
                sections.append(Section(text=body, heading=heading))
            heading, lines = m.group(2), [line]
        else:
            lines.append(line)
    body = "\n".join(lines).strip()
    if body:
        sections.append(Section(text=body, heading=heading))
    return sections


class _Zip:
    """A zip archive read with caps: member count, bytes out, and growth per member."""

    def __init__(self, p: Path, limits: DocumentLimits) -> None:
        self.name, self.limits = p.name, limits
        try:
            self.zf = zipfile.ZipFile(p)
        except (zipfile.BadZipFile, OSError):
            raise DocumentError(f"{p.name}: the archive is damaged; save it again and drop the copy.") from None
        infos = self.zf.infolist()
        if len(infos) > limits.max_zip_members:
            raise DocumentError(f"{p.name}: {len(infos):,} parts inside is more than a document holds; refused.")
        total = sum(i.file_size for i in infos)
        if total > limits.max_unzipped_bytes:
            raise DocumentError(f"{p.name}: unpacks to {total / 1e6:,.0f} MB (a zip bomb?); refused.")
        self.read_bytes = 0

    def names(self) -> list[str]:
        return self.zf.namelist()

    def read(self, member: str) -> bytes:
        try:
            info = self.zf.getinfo(member)
        except KeyError:
            raise DocumentError(f"{self.name}: '{member}' is missing inside; the file is damaged.") from None
        if info.file_size > max(info.compress_size, 1) * self.limits.max_zip_ratio and info.file_size > 1 << 20:
            raise DocumentError(
                f"{self.name}: '{member}' unpacks {info.file_size // max(info.compress_size, 1):,}x (a zip bomb?); refused."
            )
        budget = self.limits.max_unzipped_bytes - self.read_bytes
        try:
            with self.zf.open(info) as fh:
                data = fh.read(budget + 1)  # declared sizes can lie; the cap is on what comes out
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DocumentError(f"{self.name}: '{member}' cannot be unpacked ({exc}).") from None
        if len(data) > budget:
            raise DocumentError(
                f"{self.name}: unpacks past {self.limits.max_unzipped_bytes / 1e6:,.0f} MB (a zip bomb?); refused."
            )
        self.read_bytes += len(data)
        return data


def _xml(z: _Zip, member: str) -> ElementTree.Element:
    try:
        return ElementTree.fromstring(z.read(member))
    except ElementTree.ParseError as exc:
        raise DocumentError(f"{z.name}: '{member}' is not well-formed XML ({exc}).") from None


def _docx(p: Path, limits: DocumentLimits) -> list[Section]:
    """Paragraphs of word/document.xml; a ``Heading N`` or ``Title`` style starts a section."""
    z = _Zip(p, limits)
    body = _xml(z, "word/document.xml")
    sections: list[Section] = []
    heading: str | None = None
    paras: list[str] = []
    for para in body.iter(f"{_W}p"):
        text = "".join(t.text or "" for t in para.iter(f"{_W}t")).strip()
        style = para.find(f"{_W}pPr/{_W}pStyle")
        style_name = (style.get(f"{_W}val") or "") if style is not None else ""
        if text and (style_name.lower().startswith("heading") or style_name.lower() == "title"):
            if paras:
                sections.append(Section(text="\n\n".join(paras), heading=heading))
            heading, paras = text, [text]
        elif text:
            paras.append(text)
    if paras:
        sections.append(Section(text="\n\n".join(paras), heading=heading))
    return sections


def _epub(p: Path, limits: DocumentLimits) -> list[Section]:
    """The spine's XHTML documents in reading order, each parsed as HTML."""
    z = _Zip(p, limits)
    container = _xml(z, "META-INF/container.xml")
    rootfile = next((e.get("full-path") for e in container.iter() if e.tag.endswith("rootfile")), None)
    if not rootfile:
        raise DocumentError(f"{p.name}: no package document named in META-INF/container.xml; the EPUB is damaged.")
    opf = _xml(z, rootfile)
    base = posixpath.dirname(rootfile)
    manifest = {e.get("id"): e.get("href") for e in opf.iter() if e.tag.endswith("}item")}
    spine = [e.get("idref") for e in opf.iter() if e.tag.endswith("}itemref")]
    names = set(z.names())
    sections: list[Section] = []
    for idref in spine:
        href = manifest.get(idref)
        member = posixpath.normpath(posixpath.join(base, href)) if href else None
        if member in names:
            sections.extend(html_sections(z.read(member).decode("utf-8", errors="replace")))
    return sections
