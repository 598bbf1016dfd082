"""Extraction per format, and each bad input refused in one line naming the file."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from engine.documents.extract import extract, markdown_sections
from engine.documents.html_text import html_sections
from engine.documents.limits import DocumentError, DocumentLimits, check_file, collect

DATA = Path(__file__).parent / "data"


def _one_line(exc: pytest.ExceptionInfo, name: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(name), msg
    return msg


def test_pdf_keeps_page_numbers():
    doc = extract(DATA / "libtasn1.pdf")
    assert doc.kind == "pdf" and doc.pages == 36
    page10 = next(s for s in doc.sections if s.page == 10)
    assert "asn1Decoding" in page10.text and "--strict" in page10.text


def test_page_without_text_layer_is_reported():
    doc = extract(DATA / "no-text-page-2.pdf")
    assert doc.notes == ["page 2 has no text layer"]
    assert [s.page for s in doc.sections] == [1, 3]


def test_encrypted_pdf_refused():
    with pytest.raises(DocumentError) as exc:
        extract(DATA / "encrypted.pdf")
    assert "encrypted" in _one_line(exc, "encrypted.pdf")


def test_empty_file_refused(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DocumentError) as exc:
        extract(tmp_path / "empty.txt")
    assert "0 bytes" in _one_line(exc, "empty.txt")


def test_two_gigabyte_file_refused_from_its_size(tmp_path):
    big = tmp_path / "huge.pdf"
    with big.open("wb") as fh:  # sparse: nothing is written, and nothing may be read
        fh.truncate(2 * 1024**3)
    with pytest.raises(DocumentError) as exc:
        extract(big)
    assert "2.1 GB is over" in _one_line(exc, "huge.pdf")


def test_binary_named_txt_refused(tmp_path):
    (tmp_path / "data.txt").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DocumentError) as exc:
        extract(tmp_path / "data.txt")
    assert "binary" in _one_line(exc, "data.txt")


def test_unknown_kind_refused(tmp_path):
    (tmp_path / "photo.raw").write_bytes(b"x")
    with pytest.raises(DocumentError) as exc:
        check_file(tmp_path / "photo.raw")
    _one_line(exc, "photo.raw")


def test_html_scripts_and_styles_are_dropped_unrun(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(
        "<html><head><title>T</title><script>document.write('EVIL')</script></head>"
        "<body onload=\"alert('x')\"><style>p{color:red}</style><h1>Install</h1><p>Run make.</p>"
        "<script>var secret = 'EVIL2';</script><h2>Use</h2><p>Call <b>go</b> now.</p>"
        '<a href="javascript:alert(1)">link</a><noscript>enable JS</noscript></body></html>'
    )
    doc = extract(page)
    text = doc.text
    assert "EVIL" not in text and "color" not in text and "alert" not in text and "enable JS" not in text
    assert [(s.heading, s.text) for s in doc.sections] == [("Install", "Run make."), ("Use", "Call go now.\n\nlink")]


def test_html_unclosed_script_swallows_nothing_after_body():
    sections = html_sections("<p>before</p><script>if (a < b) { x() }</script><p>after</p>")
    assert [s.text for s in sections] == ["before\n\nafter"]


def test_markdown_splits_at_headings_outside_fences():
    md = "intro\n\n# One\ntext one\n```\n# not a heading\n```\n## Two\ntext two"
    sections = markdown_sections(md)
    assert [s.heading for s in sections] == [None, "One", "Two"]
    assert "# not a heading" in sections[1].text


def _docx(path: Path, body: str) -> Path:
    ns = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", f"<w:document {ns}><w:body>{body}</w:body></w:document>")
    return path


def _para(text: str, style: str | None = None) -> str:
    ppr = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    return f"<w:p>{ppr}<w:r><w:t>{text}</w:t></w:r></w:p>"


def test_docx_paragraphs_and_headings(tmp_path):
    body = (
        _para("Preface")
        + _para("Setup", "Heading1")
        + _para("Install it.")
        + _para("Use", "Heading2")
        + _para("Run it.")
    )
    doc = extract(_docx(tmp_path / "guide.docx", body))
    assert [(s.heading, s.text) for s in doc.sections] == [
        (None, "Preface"),
        ("Setup", "Setup\n\nInstall it."),
        ("Use", "Use\n\nRun it."),
    ]


def test_zip_bomb_docx_refused(tmp_path):
    # 200 MB of zeros deflates to ~200 KB: over the unzipped total before anything is read.
    bomb = tmp_path / "bomb.docx"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", "<w:document/>")
        with z.open("word/media/pad.bin", "w", force_zip64=True) as fh:
            for _ in range(200):
                fh.write(bytes(1 << 20))
    assert bomb.stat().st_size < 1_000_000
    with pytest.raises(DocumentError) as exc:
        extract(bomb)
    assert "zip bomb" in _one_line(exc, "bomb.docx")


def test_zip_bomb_member_ratio_refused(tmp_path):
    # One member growing 1000x, under the total cap: refused by its ratio.
    path = tmp_path / "ratio.docx"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", b"<a>" + b" " * (8 << 20) + b"</a>")
    with pytest.raises(DocumentError) as exc:
        extract(path, DocumentLimits(max_zip_ratio=100))
    assert "unpacks" in _one_line(exc, "ratio.docx")


def test_damaged_docx_refused(tmp_path):
    bad = tmp_path / "bad.docx"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DocumentError) as exc:
        extract(bad)
    assert "damaged" in _one_line(exc, "bad.docx")


def test_epub_spine_in_reading_order(tmp_path):
    book = tmp_path / "book.epub"
    opf = (
        '<package xmlns="http://www.idpf.org/2007/opf"><manifest>'
        '<item id="c2" href="text/ch2.xhtml"/><item id="c1" href="text/ch1.xhtml"/></manifest>'
        '<spine><itemref idref="c1"/><itemref idref="c2"/></spine></package>'
    )
    with zipfile.ZipFile(book, "w") as z:
        z.writestr("mimetype", "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<container><rootfiles><rootfile full-path="OEBPS/content.opf"/></rootfiles></container>',
        )
        z.writestr("OEBPS/content.opf", opf)
        z.writestr("OEBPS/text/ch1.xhtml", "<html><body><h1>Chapter 1</h1><p>It begins.</p></body></html>")
        z.writestr(
            "OEBPS/text/ch2.xhtml", "<html><body><h1>Chapter 2</h1><p>It ends.</p><script>x()</script></body></html>"
        )
    doc = extract(book)
    assert [(s.heading, s.text) for s in doc.sections] == [("Chapter 1", "It begins."), ("Chapter 2", "It ends.")]


def test_folder_of_50000_files_refused_in_one_line(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(50_000):
        (folder / f"{i:05}.txt").touch()
    with pytest.raises(DocumentError) as exc:
        collect([folder])
    assert "drop a smaller folder" in _one_line(exc, "many")


def test_folder_walk_skips_hidden_and_other_kinds(tmp_path):
    (tmp_path / "a.md").write_text("# A\nx")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "b.md").write_text("y")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("print(1)")
    (tmp_path / "sub" / "d.bin").write_bytes(b"\x00")
    files, _ = collect([tmp_path])
    assert [f.name for f in files] == ["a.md", "c.py"]
