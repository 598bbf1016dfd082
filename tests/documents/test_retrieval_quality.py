"""Retrieval quality: the right page in the top 3 for at least 90% of 48 questions, lexical only.

The questions (data/questions.json) were written from reading the two manuals' pages;
``pages`` lists each page that answers (two where an answer spans a page break or is
said twice). The index is the one the app builds: the same extraction, chunking and BM25.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.documents.index import DocumentIndex
from engine.documents.retrieval import retrieve

DATA = Path(__file__).parent / "data"
MANUALS = ["shared-mime-info-spec.pdf", "libtasn1.pdf"]


def hit_rate(ix: DocumentIndex, questions: list[dict], k: int = 3) -> tuple[float, list[str]]:
    misses = []
    for q in questions:
        got = [(Path(h.path).name, h.page) for h in retrieve(ix, q["q"], k)]
        if not any(name == q["file"] and page in q["pages"] for name, page in got):
            misses.append(f"{q['q']} wants {q['file']} p{q['pages']}, got {got}")
    return 1 - len(misses) / len(questions), misses


def test_lexical_top3_page_hit_rate(tmp_path):
    ix = DocumentIndex(tmp_path / "index.sqlite")
    last = list(ix.index_paths([DATA / m for m in MANUALS]))[-1]
    assert last.line() == "indexed 53 pages from 2 files" and last.notes == []
    questions = json.loads((DATA / "questions.json").read_text())
    assert len(questions) >= 30
    rate, misses = hit_rate(ix, questions)
    assert rate >= 0.9, "\n".join(misses)
