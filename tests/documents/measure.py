"""Measures for docs/documents.md: indexing speed, retrieval time, and hit rates with and
without vectors from a tiny (random-weight) embedding model.

    PYTHONPATH=. python tests/documents/measure.py [EMBEDDING_MODEL_DIR]
    PYTHONPATH=. python tests/documents/measure.py --scale   # 40 copies: 1,060 pages

Without an argument the vectors come from tests/golden/embeddings/qwen3_embedding (a
tiny random Qwen3-Embedding: its vectors carry no meaning, so this checks the plumbing
and the cost, not the quality). Pass a real embedding model folder to measure quality.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from engine.documents.index import DocumentIndex
from engine.documents.retrieval import retrieve

HERE = Path(__file__).parent
DATA = HERE / "data"
MANUALS = [DATA / "shared-mime-info-spec.pdf", DATA / "libtasn1.pdf"]


def rate(ix: DocumentIndex, questions: list[dict], vec_of=None, model: str = "") -> float:
    good = 0
    for q in questions:
        qv = vec_of(q["q"]) if vec_of else None
        got = [(Path(h.path).name, h.page) for h in retrieve(ix, q["q"], 3, qv, model)]
        good += any(n == q["file"] and p in q["pages"] for n, p in got)
    return good / len(questions)


def main() -> None:
    from engine.runtime.host import ModelHost

    model_dir = sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent / "golden" / "embeddings" / "qwen3_embedding")
    questions = json.loads((DATA / "questions.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        ix = DocumentIndex(Path(tmp) / "index.sqlite")
        t0 = time.perf_counter()
        last = list(ix.index_paths(MANUALS))[-1]
        index_s = time.perf_counter() - t0
        n_chunks = len(ix.all_chunks())
        print(
            f"lexical index: {last.pages_done} pages, {n_chunks} chunks in {index_s:.2f} s = {last.pages_done / index_s:.0f} pages/s"
        )
        t0 = time.perf_counter()
        lexical = rate(ix, questions)
        per_q = (time.perf_counter() - t0) / len(questions) * 1000
        print(f"lexical top-3 page hit rate: {lexical:.1%} ({len(questions)} questions), {per_q:.2f} ms per question")

        host = ModelHost()
        host.load(model_dir)
        name = Path(model_dir).name

        def embed(texts):
            return host.embed(texts).vectors

        t0 = time.perf_counter()
        ix.embed_missing(embed, name)
        embed_s = time.perf_counter() - t0
        print(f"embedding {n_chunks} chunks with {name}: {embed_s:.2f} s = {last.pages_done / embed_s:.1f} pages/s")
        qvecs = {q["q"]: v for q, v in zip(questions, embed([q["q"] for q in questions]))}
        t0 = time.perf_counter()
        for q in questions:
            ix.search_vector(qvecs[q["q"]], name, 20)
        vec_ms = (time.perf_counter() - t0) / len(questions) * 1000
        print(
            f"vector search over {n_chunks} float32 blobs: {vec_ms:.2f} ms per question (first call loads the matrix)"
        )
        print(f"vector-only top-3 hit rate: {rate_vec_only(ix, questions, qvecs, name):.1%}")
        print(f"hybrid (RRF) top-3 hit rate: {rate(ix, questions, qvecs.__getitem__, name):.1%}")


def rate_vec_only(ix: DocumentIndex, questions: list[dict], qvecs: dict, model: str) -> float:
    good = 0
    for q in questions:
        got = [(Path(h.path).name, h.page) for h in ix.search_vector(qvecs[q["q"]], model, 3)]
        good += any(n == q["file"] and p in q["pages"] for n, p in got)
    return good / len(questions)


def scale(copies: int = 20) -> None:
    """Indexing and BM25 at ~1,000 pages: the manuals copied (each copy's bytes differ)."""
    questions = json.loads((DATA / "questions.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for i in range(copies):
            for m in MANUALS:
                (src / f"{i:02}-{m.name}").write_bytes(m.read_bytes() + f"\n%{i}\n".encode())
        ix = DocumentIndex(Path(tmp) / "index.sqlite")
        t0 = time.perf_counter()
        last = list(ix.index_paths([src]))[-1]
        dt = time.perf_counter() - t0
        n_chunks = len(ix.all_chunks())
        print(f"{last.line()} in {dt:.1f} s = {last.pages_done / dt:.0f} pages/s ({n_chunks} chunks)")
        t0 = time.perf_counter()
        for q in questions:
            retrieve(ix, q["q"], 5)
        print(f"BM25 over {n_chunks} chunks: {(time.perf_counter() - t0) / len(questions) * 1000:.1f} ms per question")
        t0 = time.perf_counter()
        ix.refresh()
        print(f"refresh, nothing changed ({copies * len(MANUALS)} files): {(time.perf_counter() - t0) * 1000:.0f} ms")


if __name__ == "__main__":
    if sys.argv[1:] == ["--scale"]:
        scale()
    else:
        main()
