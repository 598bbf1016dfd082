"""The SQLite index: updates when a file changes, fusion, what goes in the prompt, deletion."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from engine.documents.chunking import split_text
from engine.documents.index import DocumentIndex, Hit, fts_query
from engine.documents.retrieval import build_context, fuse, retrieve

DATA = Path(__file__).parent / "data"


def _write(path: Path, text: str, mtime: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime, mtime))


def test_file_change_reindexes_and_unchanged_file_is_not_read_again(tmp_path):
    notes = tmp_path / "notes.md"
    _write(notes, "# Plants\nThe fern likes shade.", 1_000_000_000)
    ix = DocumentIndex(tmp_path / "chat" / "index.sqlite")
    ix.add(notes)
    assert [h.heading for h in ix.search_lexical("fern shade")] == ["Plants"]
    ix.add(notes)  # same size and mtime: nothing changes
    assert len(ix.all_chunks()) == 1
    _write(notes, "# Plants\nThe cactus likes sun.", 2_000_000_000)
    assert ix.refresh() == []
    assert ix.search_lexical("fern") == []
    assert [h.text for h in ix.search_lexical("cactus")] == ["# Plants\nThe cactus likes sun."]
    notes.unlink()
    assert ix.refresh() == ["notes.md: gone from disk, taken out of the index"]
    assert ix.all_chunks() == [] and ix.search_lexical("cactus") == []


def test_index_is_deleted_with_the_chat(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello index")
    db = tmp_path / "chat-1" / "index.sqlite"
    ix = DocumentIndex(db)
    ix.add(src)
    assert db.exists()
    ix.delete()
    assert not any(db.parent.iterdir())


def test_progress_and_cancel_between_files(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text(f"file number {i} " * 50)
    ix = DocumentIndex(tmp_path / "ix.sqlite")
    seen = []
    stop = {"now": False}
    for p in ix.index_paths([tmp_path], cancelled=lambda: stop["now"]):
        seen.append(p.line())
        if p.files_done == 2:
            stop["now"] = True
    assert seen[0] == "indexing 0 pages (file 1 of 5)"
    assert len(ix.files()) == 2  # the two read before the cancel, each whole
    done = list(ix.index_paths([tmp_path]))
    assert done[-1].line() == "indexed 5 pages from 5 files"


def test_a_refused_file_is_a_note_and_the_rest_is_indexed(tmp_path):
    (tmp_path / "good.txt").write_text("useful words")
    (tmp_path / "empty.txt").write_bytes(b"")
    shutil.copy(DATA / "encrypted.pdf", tmp_path / "locked.pdf")
    ix = DocumentIndex(tmp_path / "ix.sqlite")
    last = list(ix.index_paths([tmp_path]))[-1]
    assert last.notes == [
        "empty.txt: the file is empty (0 bytes).",
        "locked.pdf: the PDF is encrypted; save an unlocked copy and drop that.",
    ]
    assert [Path(f["path"]).name for f in ix.files()] == ["good.txt"]


def test_chunks_keep_paragraphs_and_overlap():
    paras = [f"Paragraph {i} says a thing. It ends here." for i in range(60)]
    chunks = split_text("\n\n".join(paras), target=300, overlap=80)
    assert all(len(c) <= 300 + 80 for c in chunks)
    overlap = chunks[1].split("\n\n")[0]  # the last whole sentences of the chunk before
    assert chunks[0].replace("\n\n", " ").endswith(overlap) and 0 < len(overlap) <= 80
    assert all(p in "".join(chunks) for p in paras)


def test_reciprocal_rank_fusion_prefers_agreement():
    def hits(*ids):
        return [Hit(i, "f", None, None, str(i), 0.0) for i in ids]

    fused = fuse(hits(1, 2, 3), hits(4, 2, 5))  # 2 is second in both: 2/62 beats 1/61
    assert [h.chunk_id for h in fused] == [2, 1, 4, 3, 5]


def test_vectors_ranked_by_cosine_and_fused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("apples are red fruit")
    b.write_text("the sky is blue today")
    ix = DocumentIndex(tmp_path / "ix.sqlite")
    ix.add(a)
    ix.add(b)
    table = {"apples are red fruit": [1.0, 0.0], "the sky is blue today": [0.0, 1.0]}
    assert ix.embed_missing(lambda texts: [table[t] for t in texts], "toy") == 2
    assert ix.embed_missing(lambda texts: [table[t] for t in texts], "toy") == 0
    top = ix.search_vector(list(np.array([0.1, 0.9])), "toy", 2)
    assert [Path(h.path).name for h in top] == ["b.txt", "a.txt"]
    assert [Path(h.path).name for h in retrieve(ix, "what colour is the sky", 1, [0.1, 0.9], "toy")] == ["b.txt"]


def test_all_of_it_goes_in_when_it_fits(tmp_path):
    ix = DocumentIndex(tmp_path / "ix.sqlite")
    ix.add(DATA / "shared-mime-info-spec.pdf")
    whole = build_context(ix, "magic string", budget_chars=10**6)
    assert whole.whole and [s.page for s in whole.sources] == list(range(1, 18))
    assert "[9] shared-mime-info-spec.pdf, page 9\n" in whole.text
    question = "What magic string does the magic file start with?"
    some = build_context(ix, question, budget_chars=4000, k=3)
    assert not some.whole and len(some.sources) == 3 and 9 in [s.page for s in some.sources]
    assert sum(len(s.passage) for s in some.sources) <= 4000
    one = build_context(ix, question, budget_chars=100, k=3)  # the best chunk, whatever its size
    assert len(one.sources) == 1 and [s.page for s in one.top] == [s.page for s in some.top]
    assert "cite" in some.text.lower()


def test_fts_query_is_safe_for_any_text():
    assert fts_query('what is "NEAR" OR (foo* AND -bar)?') == '"near" OR "foo" OR "bar"'
    assert fts_query("the of and") == ""
