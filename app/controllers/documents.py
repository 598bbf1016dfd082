"""Documents in a chat: dropped files and folders indexed per chat, and read into replies.

Each chat's index is ``<data dir>/documents/<chat id>/index.sqlite`` (engine/documents),
deleted with the chat. Indexing is plain file and SQLite work, no MLX, so it runs on a
thread of its own, one drop at a time, while the engine keeps answering; it reports
"indexing 1,240 pages, 40 s left" as it goes and stops between files on ``cancel()``,
keeping what it finished. With an embedding model loaded beside the chat model
(``use_embedder``), the new chunks are then embedded on the engine thread, a batch per
request so replies interleave, with progress and the same cancel. Before a reply,
``context`` reads again the files changed on disk since (dropping those gone), then gives the sources block for the prompt: every document whole when they fit
a third of the model's context (at ~3 characters a token), else the top chunks by BM25,
fused with the vector ranking when there is an embedder. No widgets here.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from app.bridge import EngineRequestError, EngineUnavailable
from app.ops import Op
from app.qt import QObject, Signal, emit
from engine.documents.index import DocumentIndex
from engine.documents.limits import DocumentError, is_document
from engine.documents.retrieval import Context, build_context

DOCUMENTS_DIR = "documents"
EMBED_BATCH = 8  # chunks per engine request: small enough that a reply waits little


class DocumentsController(QObject):
    progress = Signal(str)  # "indexing 1,240 pages, 40 s left (file 3 of 12)"
    finished = Signal(int, str)  # chat id, the summary line (notes included)
    failed = Signal(str)  # a drop refused as a whole, in one line

    def __init__(self, data_dir: str | Path, parent: QObject | None = None):
        super().__init__(parent)
        self.root = Path(data_dir) / DOCUMENTS_DIR
        self._cancel: threading.Event | None = None
        self._indexing: int | None = None  # the chat whose drop is being indexed
        self.embedder: str | None = None  # the embedding model's name, keying its vectors
        self._embed: Callable[[list[str]], Awaitable[list[list[float]]]] | None = None

    def use_embedder(self, name: str | None, embed: Callable[[list[str]], Awaitable[list[list[float]]]] | None) -> None:
        """Vectors from this model from now on (None: lexical retrieval only)."""
        self.embedder, self._embed = (name, embed) if name and embed else (None, None)

    @staticmethod
    def wanted(path: str) -> bool:
        """Whether a dropped path is for the index (a document or a folder), not an attachment."""
        return Path(path).is_dir() or is_document(path)

    def index_file(self, conversation_id: int) -> Path:
        return self.root / str(conversation_id) / "index.sqlite"

    def has_documents(self, conversation_id: int | None) -> bool:
        return conversation_id is not None and self.index_file(conversation_id).exists()

    @property
    def busy(self) -> bool:
        return self._cancel is not None

    def cancel(self) -> bool:
        if self._cancel is None:
            return False
        self._cancel.set()
        return True

    async def add(self, conversation_id: int, paths: list[str]) -> list[str]:
        """Index the drop into the chat's index; the files indexed (all, on success)."""
        if self._cancel is not None:
            emit(self.failed, "Documents are being indexed; wait for them or cancel first.")
            return []
        cancel = self._cancel = threading.Event()
        self._indexing = conversation_id
        loop = asyncio.get_running_loop()

        def work() -> tuple[str, list[str], bool]:
            ix = DocumentIndex(self.index_file(conversation_id))
            try:
                last = None
                for last in ix.index_paths([Path(p) for p in paths], cancelled=cancel.is_set):
                    loop.call_soon_threadsafe(emit, self.progress, last.line())
                files = [f["path"] for f in ix.files()]
            finally:
                ix.close()
            if last is None:
                return "", files, cancel.is_set()
            summary = last.line() if not cancel.is_set() else f"Indexing cancelled; {len(files)} files kept"
            return " · ".join([summary, *last.notes]), files, cancel.is_set()

        try:
            summary, files, stopped = await Op(work)
            if self._embed is not None and not stopped:
                note = await self._embed_new(conversation_id, cancel)
                summary = f"{summary} · {note}" if note else summary
        except (DocumentError, OSError) as exc:
            emit(self.failed, str(exc))
            return []
        except (EngineRequestError, EngineUnavailable) as exc:  # the embedder failed: the lexical index stands
            summary = f"{summary} · embedding stopped ({exc}); answers use the words' index"
        finally:
            self._cancel = self._indexing = None
        emit(self.finished, conversation_id, summary)
        return files

    async def _embed_new(self, conversation_id: int, cancel: threading.Event) -> str:
        """Embed the chunks without a vector from the current embedder; a note, or ""."""
        model, embed, path = self.embedder or "", self._embed, self.index_file(conversation_id)
        assert embed is not None

        def read() -> list[tuple[int, str]]:
            ix = DocumentIndex(path)
            try:
                return ix.missing_vectors(model)
            finally:
                ix.close()

        def write(ids: list[int], vectors: list[list[float]]) -> None:
            ix = DocumentIndex(path)
            try:
                ix.put_vectors(model, ids, vectors)
            finally:
                ix.close()

        rows = await Op(read)
        start = time.monotonic()
        for done in range(0, len(rows), EMBED_BATCH):
            if cancel.is_set():
                return f"embedding cancelled after {done:,} of {len(rows):,} chunks"
            elapsed = time.monotonic() - start
            left = f", {elapsed * (len(rows) - done) / done:.0f} s left" if done else ""
            emit(self.progress, f"embedding {len(rows):,} chunks with {model}{left}")
            part = rows[done : done + EMBED_BATCH]
            vectors = await embed([text for _, text in part])
            await Op(write, [cid for cid, _ in part], vectors)
        return f"{len(rows):,} chunks embedded with {model}" if rows else ""

    def listing(self, conversation_id: int | None) -> list[dict[str, Any]]:
        """The chat's documents (path, kind, pages, notes), in the order they were added."""
        if not self.has_documents(conversation_id):
            return []
        ix = DocumentIndex(self.index_file(conversation_id))  # type: ignore[arg-type]
        try:
            return ix.files()
        finally:
            ix.close()

    def remove(self, conversation_id: int, path: str) -> None:
        """Take one document out of the chat (the file itself stays where it is)."""
        if self._indexing == conversation_id or not self.has_documents(conversation_id):
            return
        ix = DocumentIndex(self.index_file(conversation_id))
        try:
            ix.remove(path)
        finally:
            ix.close()

    def forget(self, conversation_id: int) -> None:
        """The chat is deleted: its index goes too (a drop still indexing it is stopped)."""
        if self._indexing == conversation_id:
            self.cancel()
        shutil.rmtree(self.root / str(conversation_id), ignore_errors=True)

    async def context(self, conversation_id: int, question: str, context_tokens: int) -> Context | None:
        if not self.has_documents(conversation_id):
            return None
        if self._indexing == conversation_id:
            emit(self.progress, "The documents are still being indexed: this reply reads none of them.")
            return None
        budget = max(2000, context_tokens)  # a third of the context, at ~3 characters a token
        query_vec = None
        if self._embed is not None:
            try:
                query_vec = (await self._embed([question]))[0]
            except (EngineRequestError, EngineUnavailable):  # the embedder went away: words alone answer
                query_vec = None

        def work() -> tuple[Context, list[str]]:
            ix = DocumentIndex(self.index_file(conversation_id))
            try:
                changed = ix.refresh()  # files edited since: read again; files gone: out
                return build_context(ix, question, budget, query_vec=query_vec, model=self.embedder or ""), changed
            finally:
                ix.close()

        ctx, changed = await Op(work)
        if changed:
            emit(self.progress, " · ".join(changed))
        return ctx
