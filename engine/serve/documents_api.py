"""Documents sent inline on chat completions: OpenAI's file content parts, read as the app reads drops.

A user message may carry ``{"type": "file", "file": {"filename", "file_data"}}`` (Chat
Completions) or ``{"type": "input_file", "filename", "file_data"}`` (the Responses
spelling), ``file_data`` a base64 ``data:`` URL or bare base64. There is no file store:
a ``file_id`` is refused. Each message's documents are written to a private temporary
folder, extracted and indexed there (engine/documents), and replaced by one text part:
every page when they fit a third of the model's context (at ~3 characters a token),
else the chunks that best match the message's own text, numbered for citing. The folder
is gone when the request has been read. Any refusal is a 400 naming the file.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from engine.documents.index import DocumentIndex
from engine.documents.limits import DocumentError
from engine.documents.retrieval import build_context
from engine.serve.common import decode_base64, decode_data_url
from engine.serve.http import ApiError

FILE_PARTS = ("file", "input_file")


def file_part(part: dict[str, Any]) -> dict[str, Any]:
    """A file content part as ``{"type": "document", "filename", "data"}`` (bytes)."""
    spec = part.get("file") if part.get("type") == "file" else part
    if not isinstance(spec, dict):
        raise ApiError(400, "A file part needs file.filename and file.file_data.", param="messages")
    if spec.get("file_id") and not spec.get("file_data"):
        raise ApiError(
            400, "This server keeps no uploaded files: send file_data (base64) instead of file_id.", param="messages"
        )
    data, name = spec.get("file_data"), spec.get("filename")
    if not isinstance(data, str) or not isinstance(name, str) or not name.strip():
        raise ApiError(400, "A file part needs a filename and file_data (base64).", param="messages")
    raw = decode_data_url(data, "file") if data.startswith("data:") else decode_base64(data, "file")
    return {"type": "document", "filename": name, "data": raw}


def read_documents(messages: list[dict[str, Any]], context_tokens: int) -> None:
    """Replace each message's document parts by the text the model should read, in place."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(p.get("type") == "document" for p in content):
            continue
        question = " ".join(p["text"] for p in content if p.get("type") == "text")
        block = _sources_block([p for p in content if p.get("type") == "document"], question, context_tokens)
        rest = [p for p in content if p.get("type") != "document"]
        parts = [{"type": "text", "text": block + "\n\n"}, *rest]
        text_only = all(p["type"] == "text" for p in parts)
        message["content"] = "".join(p["text"] for p in parts) if text_only else parts


def _sources_block(documents: list[dict[str, Any]], question: str, context_tokens: int) -> str:
    with tempfile.TemporaryDirectory(prefix="mlx-desk-docs-") as tmp:
        folder = Path(tmp)
        paths = []
        for i, doc in enumerate(documents):
            name = re.sub(r"[^\w.\- ]", "_", Path(doc["filename"]).name)[:120] or f"document-{i}"
            path = folder / "files" / str(i) / name  # one folder each: two files may share a name
            path.parent.mkdir(parents=True)
            path.write_bytes(doc["data"])
            paths.append(path)
        ix = DocumentIndex(folder / "index.sqlite")
        try:
            for path in paths:
                try:
                    ix.add(path)
                except DocumentError as exc:
                    raise ApiError(400, str(exc), param="messages") from None
            ctx = build_context(ix, question, max(2000, context_tokens))
        finally:
            ix.close()
        return ctx.text  # sources are labelled by file name (as sent) and page, never the folder
