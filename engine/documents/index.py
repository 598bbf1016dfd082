"""One chat's documents in one SQLite file: chunks, an FTS5 index over them, and vectors.

Tables: ``files`` (path, size, mtime, sha256, page count, notes), ``chunks`` (text, page,
heading, order), ``chunks_fts`` (FTS5 over text and heading, porter stemming, BM25 ranks),
``vectors`` (one float32 blob per chunk and embedding model). Vectors live in a plain blob
table scored by one numpy matrix product: at a chat's scale (thousands of chunks) this
takes about a millisecond (docs/documents.md measures it), with no extension to load.

``add`` re-reads a file only when its size or mtime changed and then its content hash;
``refresh`` does that for every file; ``delete`` removes the file (the chat's folder
with it). Not thread-safe: one connection, used from one thread.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.documents.chunking import chunk_document
from engine.documents.extract import extract
from engine.documents.limits import DEFAULT_LIMITS, DocumentError, DocumentLimits, check_file, collect

Embedder = Callable[[list[str]], list[list[float]]]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY, path TEXT UNIQUE NOT NULL, size INTEGER, mtime_ns INTEGER,
    sha256 TEXT, kind TEXT, pages INTEGER, notes TEXT, chars INTEGER);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, file_id INTEGER NOT NULL REFERENCES files(id) ON DELETE CASCADE,
    ordinal INTEGER, page INTEGER, heading TEXT, text TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_file ON chunks(file_id);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, heading, tokenize='porter unicode61');
CREATE TABLE IF NOT EXISTS vectors (
    chunk_id INTEGER NOT NULL REFERENCES chunks(id) ON DELETE CASCADE, model TEXT NOT NULL,
    vec BLOB NOT NULL, PRIMARY KEY (chunk_id, model));
"""

# Words too common to rank by; FTS5 would match nearly every chunk on them.
_STOP = set(
    "a an and are as at be by can do does for from how i in is it its of on or that the this to "
    "what when where which who why will with you your there their was were should would could "
    "into about than then them they these those has have had not no yes if so".split()
)


@dataclass
class Hit:
    chunk_id: int
    path: str
    page: int | None
    heading: str | None
    text: str
    score: float  # higher is better; its scale depends on the ranking


@dataclass
class Progress:
    files_done: int
    files_total: int
    pages_done: int
    seconds_left: float | None
    current: str  # the file being read
    notes: list[str]  # one line per file skipped or page without text, so far

    def line(self) -> str:
        if self.files_done >= self.files_total:
            return f"indexed {self.pages_done:,} pages from {self.files_total:,} files"
        left = f", {self.seconds_left:.0f} s left" if self.seconds_left is not None else ""
        return f"indexing {self.pages_done:,} pages{left} (file {self.files_done + 1:,} of {self.files_total:,})"


class DocumentIndex:
    def __init__(self, db_path: str | Path, limits: DocumentLimits = DEFAULT_LIMITS) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.db = sqlite3.connect(str(self.db_path))
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(_SCHEMA)
        self._matrix: dict[str, tuple[Any, Any]] = {}  # model -> (chunk ids, unit vectors), numpy

    def close(self) -> None:
        self.db.close()

    def delete(self) -> None:
        """Close and remove the index file: the chat it belonged to is gone."""
        self.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.db_path}{suffix}").unlink(missing_ok=True)

    # --- adding -----------------------------------------------------------------------

    def add(self, path: str | Path, embed: Embedder | None = None, model: str = "") -> tuple[int, list[str]]:
        """Index one file (again only if it changed); its page count and notes."""
        p = Path(path).resolve()
        check_file(p, self.limits)  # gone, empty, too big, not a document: refused before reading
        st = p.stat()
        row = self.db.execute(
            "SELECT id, size, mtime_ns, sha256, pages, notes FROM files WHERE path = ?", (str(p),)
        ).fetchone()
        if row and row[1] == st.st_size and row[2] == st.st_mtime_ns:
            return row[4], _split_notes(row[5])
        digest = _sha256(p)
        if row and row[3] == digest:
            self.db.execute("UPDATE files SET mtime_ns = ? WHERE id = ?", (st.st_mtime_ns, row[0]))
            self.db.commit()
            return row[4], _split_notes(row[5])
        doc = extract(p, self.limits)
        chunks = chunk_document(doc)
        with self.db:
            if row:
                self._drop_file(row[0])
            cur = self.db.execute(
                "INSERT INTO files (path, size, mtime_ns, sha256, kind, pages, notes, chars) VALUES (?,?,?,?,?,?,?,?)",
                (str(p), st.st_size, st.st_mtime_ns, digest, doc.kind, doc.pages, "\n".join(doc.notes), len(doc.text)),
            )
            file_id = cur.lastrowid
            for c in chunks:
                cid = self.db.execute(
                    "INSERT INTO chunks (file_id, ordinal, page, heading, text) VALUES (?,?,?,?,?)",
                    (file_id, c.ordinal, c.page, c.heading, c.text),
                ).lastrowid
                self.db.execute(
                    "INSERT INTO chunks_fts (rowid, text, heading) VALUES (?,?,?)", (cid, c.text, c.heading or "")
                )
        if embed is not None:
            self.embed_missing(embed, model)
        self._matrix.clear()
        return doc.pages, doc.notes

    def index_paths(self, paths: list[Path], cancelled: Callable[[], bool] = lambda: False) -> Iterator[Progress]:
        """Index dropped files and folders one file at a time, yielding progress before each.

        Each file is indexed whole or not at all, so stopping between yields (``cancelled``
        or just not iterating further) leaves the index consistent. A file refused by a
        limit becomes a note; a drop refused as a whole (a folder too big) raises.
        """
        files, notes = collect(paths, self.limits)
        sizes = [f.stat().st_size if f.exists() else 0 for f in files]
        total, done_bytes, pages = sum(sizes) or 1, 0, 0
        start = time.monotonic()
        for i, (f, size) in enumerate(zip(files, sizes)):
            elapsed = time.monotonic() - start
            left = elapsed * (total - done_bytes) / done_bytes if done_bytes and elapsed > 0.5 else None
            yield Progress(i, len(files), pages, left, f.name, list(notes))
            if cancelled():
                return
            try:
                n, file_notes = self.add(f)
                pages += n
                notes.extend(f"{f.name}: {n}" for n in file_notes)
            except DocumentError as exc:
                notes.append(str(exc))
            except OSError as exc:  # unreadable (permissions, a disk error): the rest goes on
                notes.append(f"{f.name}: cannot be read ({exc.strerror or exc}).")
            done_bytes += size
        yield Progress(len(files), len(files), pages, 0.0, "", notes)

    def embed_missing(self, embed: Embedder, model: str, batch: int = 16) -> int:
        """Embed every chunk that has no vector from ``model`` yet; how many were embedded."""
        rows = self.missing_vectors(model)
        for start in range(0, len(rows), batch):
            part = rows[start : start + batch]
            self.put_vectors(model, [cid for cid, _ in part], embed([text for _, text in part]))
        return len(rows)

    def missing_vectors(self, model: str) -> list[tuple[int, str]]:
        """(chunk id, text) of each chunk without a vector from ``model``, in document order."""
        return self.db.execute(
            "SELECT id, text FROM chunks WHERE id NOT IN (SELECT chunk_id FROM vectors WHERE model = ?) ORDER BY id",
            (model,),
        ).fetchall()

    def put_vectors(self, model: str, chunk_ids: list[int], vectors: list[list[float]]) -> None:
        import numpy as np  # only when there are vectors: the app's first window goes without it

        with self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO vectors (chunk_id, model, vec) VALUES (?,?,?)",
                [(cid, model, np.asarray(v, dtype=np.float32).tobytes()) for cid, v in zip(chunk_ids, vectors)],
            )
        self._matrix.pop(model, None)

    def refresh(self) -> list[str]:
        """Re-index files that changed on disk, drop those that are gone; a line for each."""
        lines = []
        for fid, path in self.db.execute("SELECT id, path FROM files").fetchall():
            p = Path(path)
            if not p.exists():
                with self.db:
                    self._drop_file(fid)
                lines.append(f"{p.name}: gone from disk, taken out of the index")
                continue
            try:
                self.add(p)
            except DocumentError as exc:
                lines.append(str(exc))
            except OSError as exc:
                lines.append(f"{p.name}: cannot be read ({exc.strerror or exc}).")
        self._matrix.clear()
        return lines

    def remove(self, path: str | Path) -> None:
        row = self.db.execute("SELECT id FROM files WHERE path = ?", (str(Path(path).resolve()),)).fetchone()
        if row:
            with self.db:
                self._drop_file(row[0])
            self._matrix.clear()

    def _drop_file(self, file_id: int) -> None:
        ids = [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE file_id = ?", (file_id,))]
        self.db.executemany("DELETE FROM chunks_fts WHERE rowid = ?", [(i,) for i in ids])
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    # --- reading ------------------------------------------------------------------------

    def files(self) -> list[dict]:
        cols = ("path", "kind", "pages", "notes", "chars")
        return [dict(zip(cols, r)) for r in self.db.execute(f"SELECT {', '.join(cols)} FROM files ORDER BY id")]

    def total_chars(self) -> int:
        return self.db.execute("SELECT COALESCE(SUM(chars), 0) FROM files").fetchone()[0]

    def all_chunks(self) -> list[Hit]:
        return self._hits(self.db.execute(_HIT_SQL + " ORDER BY f.id, c.ordinal").fetchall(), None)

    def search_lexical(self, query: str, k: int = 8) -> list[Hit]:
        match = fts_query(query)
        if not match:
            return []
        rows = self.db.execute(
            "SELECT c.id, f.path, c.page, c.heading, c.text, bm25(chunks_fts, 1.0, 0.5) AS rank "
            "FROM chunks_fts JOIN chunks c ON c.id = chunks_fts.rowid JOIN files f ON f.id = c.file_id "
            "WHERE chunks_fts MATCH ? ORDER BY rank LIMIT ?",
            (match, k),
        ).fetchall()
        return [Hit(r[0], r[1], r[2], r[3], r[4], -r[5]) for r in rows]

    def search_vector(self, query_vec: list[float], model: str, k: int = 8) -> list[Hit]:
        import numpy as np

        if model not in self._matrix:
            rows = self.db.execute("SELECT chunk_id, vec FROM vectors WHERE model = ?", (model,)).fetchall()
            if not rows:
                return []
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            mat = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), -1)
            # Normalised once per load, so a query is one matrix-vector product (cosine).
            self._matrix[model] = (ids, mat / (np.linalg.norm(mat, axis=1, keepdims=True) + 1e-12))
        ids, mat = self._matrix[model]
        q = np.asarray(query_vec, dtype=np.float32)
        scores = mat @ (q / (np.linalg.norm(q) or 1.0))
        top = np.argpartition(-scores, min(k, len(scores)) - 1)[:k] if len(scores) > k else np.arange(len(scores))
        top = top[np.argsort(-scores[top])]
        by_id = {int(ids[i]): float(scores[i]) for i in top}
        placeholders = ",".join("?" * len(by_id))
        rows = self.db.execute(_HIT_SQL + f" WHERE c.id IN ({placeholders})", list(by_id)).fetchall()
        return sorted(self._hits(rows, by_id), key=lambda h: -h.score)

    @staticmethod
    def _hits(rows: list, scores: dict[int, float] | None) -> list[Hit]:
        return [Hit(r[0], r[1], r[2], r[3], r[4], scores[r[0]] if scores else 0.0) for r in rows]


_HIT_SQL = "SELECT c.id, f.path, c.page, c.heading, c.text FROM chunks c JOIN files f ON f.id = c.file_id"


def fts_query(question: str) -> str:
    """A question as an FTS5 query: its words (stop words out), each quoted, OR-ed for BM25."""
    words = [w for w in re.findall(r"\w+", question.lower()) if w not in _STOP and len(w) > 1]
    seen = list(dict.fromkeys(words))
    return " OR ".join(f'"{w}"' for w in seen)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _split_notes(notes: str | None) -> list[str]:
    return [n for n in (notes or "").split("\n") if n]
