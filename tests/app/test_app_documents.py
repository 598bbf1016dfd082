"""Documents in a chat, on the real engine worker with a tiny random llama: a PDF dropped,
a question, the reply's source card naming the right page and opening the file there; a
folder indexed with progress and cancelled; bad drops refused in one line, the app up."""

from __future__ import annotations

import shutil
import sqlite3
import zipfile
from pathlib import Path

import numpy as np
import pytest

from app.qt import QDesktopServices, QObject, Qt, QUrl, Slot

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

DATA = Path(__file__).resolve().parents[1] / "documents" / "data"
SEND = {"max_tokens": 8, "seed": 1, "temperature": 0.0}


class _Opened(QObject):
    """Where Qt sends file: URLs while the test holds them (no viewer opens offscreen)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[QUrl] = []

    @Slot(QUrl)
    def open(self, url: QUrl) -> None:
        self.urls.append(url)


def _drop(qtbot, window, paths: list[Path]) -> tuple[int, str]:
    with qtbot.wait_signal(window.documents.finished, timeout=60_000) as blocker:
        window.composer.add_files([str(p) for p in paths])  # what a drop on the composer calls
    return blocker.args


def test_pdf_dropped_question_answered_with_a_card_for_the_right_page(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    lines: list[str] = []
    window.documents.progress.connect(lines.append)
    cid, summary = _drop(qtbot, window, [DATA / "libtasn1.pdf"])
    assert summary == "indexed 36 pages from 1 files"
    assert lines[0] == "indexing 0 pages (file 1 of 1)"
    assert window.chat.conversation_id == cid
    assert window.composer.attachments == []  # a document is read into the chat, not attached
    window.store.update_conversation(cid, settings=SEND)

    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, "Which asn1Decoding options give strict DER decoding?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    message_id, result = blocker.args
    assert result.stats.prompt_tokens > 200  # the passages went into the prompt
    saved = window.store.message(message_id).stats["sources"]
    assert saved[0]["page"] == 10 and "Invoking asn1Decoding" in saved[0]["passage"]
    cards = window.chat_view.widgets[message_id].source_cards.cards
    assert [c.text().split("\n")[0] for c in cards][: len(saved)] == [f"libtasn1.pdf · page {s['page']}" for s in saved]

    opened = _Opened()
    QDesktopServices.setUrlHandler("file", opened, "open")
    try:
        page10 = next(c for c in cards if "page 10" in c.text())
        qtbot.mouseClick(page10, Qt.MouseButton.LeftButton)
    finally:
        QDesktopServices.unsetUrlHandler("file")
    assert [u.toLocalFile() for u in opened.urls] == [str((DATA / "libtasn1.pdf").resolve())]
    assert opened.urls[0].fragment() == "page=10"

    # The status bar says what the chat reads; a document can be taken out of it.
    assert window.documents_button.isVisibleTo(window)
    assert window.documents_button.text() == "📄 1 document · 36 pages"
    assert [a.text() for a in window.documents_button.menu().actions()] == ["libtasn1.pdf"]
    window.sidebar.new_requested.emit()  # another chat reads nothing
    assert not window.documents_button.isVisibleTo(window)
    window.open_conversation(cid)
    assert window.documents_button.isVisibleTo(window)
    take_out = window.documents_button.menu().actions()[0].menu().actions()[1]
    assert take_out.text() == "Take out of this chat"
    take_out.trigger()
    assert not window.documents_button.isVisibleTo(window) and window.documents.listing(cid) == []
    assert (DATA / "libtasn1.pdf").exists()  # the file itself is untouched

    # Deleting the chat deletes its index.
    index = window.documents.index_file(cid)
    assert index.exists()
    window.sidebar.delete(cid, confirm=False)
    assert not index.parent.exists()


def test_folder_indexed_with_progress_and_cancelled(qtbot, make_window, run_async, tmp_path):
    window = make_window()
    folder = tmp_path / "manuals"
    folder.mkdir()
    for i in range(12):
        shutil.copy(DATA / "shared-mime-info-spec.pdf", folder / f"spec-{i:02}.pdf")
    lines: list[str] = []

    def on_progress(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:
            window.stop()  # Esc: the indexing stops between files

    window.documents.progress.connect(on_progress)
    cid, summary = _drop(qtbot, window, [folder])
    # Lines come from the indexing thread, which may run a file ahead of the Esc: each
    # line is said before its file is read, and the file after the last line is not.
    assert 3 <= len(lines) < 12
    for i, line in enumerate(lines):
        assert line.split(",")[0].split(" (")[0] == f"indexing {17 * i} pages"  # "N s left" comes and goes
        assert line.endswith(f"(file {i + 1} of 12)")
    assert summary == f"Indexing cancelled; {len(lines) - 1} files kept"
    assert len(window.documents.index_file(cid).read_bytes()) > 0
    # Dropping it again picks up the rest; the two kept are not read again.
    cid2, summary = _drop(qtbot, window, [folder])
    assert (cid2, summary) == (cid, "indexed 204 pages from 12 files")


def test_bad_drops_refused_in_one_line_and_the_app_stays_up(qtbot, make_window, tmp_path):
    window = make_window()
    (tmp_path / "empty.txt").write_bytes(b"")
    shutil.copy(DATA / "encrypted.pdf", tmp_path / "locked.pdf")
    shutil.copy(DATA / "no-text-page-2.pdf", tmp_path / "scan.pdf")
    with open(tmp_path / "huge.pdf", "wb") as fh:
        fh.truncate(2 * 1024**3)
    (tmp_path / "page.html").write_text("<script>alert('x')</script><p>Plain words.</p>")
    with zipfile.ZipFile(tmp_path / "bomb.docx", "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("word/document.xml", "w", force_zip64=True) as fh:
            for _ in range(200):
                fh.write(bytes(1 << 20))  # 200 MB of zeros in ~200 KB
    cid, summary = _drop(
        qtbot,
        window,
        [tmp_path / n for n in ("empty.txt", "locked.pdf", "scan.pdf", "huge.pdf", "bomb.docx", "page.html")],
    )
    assert summary.split(" · ") == [
        "indexed 4 pages from 6 files",
        "empty.txt: the file is empty (0 bytes).",
        "locked.pdf: the PDF is encrypted; save an unlocked copy and drop that.",
        "scan.pdf: page 2 has no text layer",
        "huge.pdf: 2.1 GB is over the 100 MB limit for one document; split it or pick the part you need.",
        "bomb.docx: unpacks to 210 MB (a zip bomb?); refused.",
    ]
    db = sqlite3.connect(window.documents.index_file(cid))
    html = db.execute("SELECT c.text FROM chunks c JOIN files f ON f.id = c.file_id WHERE f.path LIKE '%page.html'")
    assert [r[0] for r in html] == ["Plain words."]  # the script is gone, unrun
    db.close()
    many = tmp_path / "many"
    many.mkdir()
    for i in range(50_000):
        (many / f"{i:05}.md").touch()
    with qtbot.wait_signal(window.documents.failed, timeout=60_000) as blocker:
        window.composer.add_files([str(many)])
    assert blocker.args == ["many: over 1,000 documents is more than one drop takes; drop a smaller folder."]
    assert window.error_banner.text() == blocker.args[0]
    assert window.isVisible() and not window.documents.busy


GOLDEN_EMBEDDER = Path(__file__).resolve().parents[1] / "golden" / "embeddings" / "qwen3_embedding"


def test_an_embedding_model_beside_the_chat_model_embeds_the_chunks_on_the_engine_thread(
    qtbot, make_window, run_async, tiny_model
):
    """The tiny (random) Qwen3-Embedding next to the tiny llama: every chunk gets a vector
    through the worker, equal to the engine embedding the text alone, and a question's
    sources come from the fused ranking (the lexical best still among them)."""
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    assert not run_async(window.set_embedder(str(tiny_model)))  # a chat model cannot embed
    assert "not a sentence embedding model" in window.error_banner.text()
    assert run_async(window.set_embedder(str(GOLDEN_EMBEDDER)))
    assert window.bridge.model_info.name == "tiny-llama"  # the chat model is still the one loaded
    lines: list[str] = []
    window.documents.progress.connect(lines.append)
    cid, summary = _drop(qtbot, window, [DATA / "shared-mime-info-spec.pdf"])
    assert summary.startswith("indexed 17 pages from 1 files · ") and summary.endswith(
        "chunks embedded with qwen3_embedding"
    )
    assert any(line.startswith("embedding ") for line in lines)

    db = sqlite3.connect(window.documents.index_file(cid))
    chunks = db.execute("SELECT count(*) FROM chunks").fetchone()[0]
    first = db.execute(
        "SELECT c.text, v.vec FROM chunks c JOIN vectors v ON v.chunk_id = c.id ORDER BY c.id"
    ).fetchone()
    assert db.execute("SELECT count(*) FROM vectors WHERE model = 'qwen3_embedding'").fetchone()[0] == chunks
    db.close()
    alone = run_async(window.bridge.embed_beside([first[0]]))[0]
    assert np.allclose(np.frombuffer(first[1], dtype=np.float32), alone, atol=1e-6)

    ctx = run_async(window.documents.context(cid, "What magic string does the magic file start with?", 2048))
    assert ctx is not None and not ctx.whole
    assert 9 in [s.page for s in ctx.top]  # BM25's right page survives fusion with random vectors
