"""A PDF sent inline on /v1/chat/completions (OpenAI's file content part), read as the
app reads a drop: the prompt is the same as sending the retrieved sources as text;
bad files are a 400 naming the file, and the server stays up."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

import openai
import pytest

from engine.documents.index import DocumentIndex
from engine.documents.retrieval import build_context
from tests.engine.serve.conftest import start_server

DATA = Path(__file__).resolve().parents[2] / "documents" / "data"
QUESTION = "What magic string does the magic file start with?"


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory.mktemp("docs-log") / "server.log")
    try:
        with openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120) as c:
            yield c
    finally:
        srv.stop()


def _file_part(path: Path, spelling: str = "file") -> dict:
    data = "data:application/pdf;base64," + base64.b64encode(path.read_bytes()).decode()
    if spelling == "file":
        return {"type": "file", "file": {"filename": path.name, "file_data": data}}
    return {"type": "input_file", "filename": path.name, "file_data": data}


def _ask(client, content):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, max_tokens=2, temperature=0, messages=[{"role": "user", "content": content}]
    )


def _expected_block(path: Path, context_tokens: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        ix = DocumentIndex(Path(tmp) / "i.sqlite")
        ix.add(path)
        ctx = build_context(ix, QUESTION, context_tokens)
        ix.close()
    assert not ctx.whole and "shared-mime-info-spec.pdf, page 9" in [s.label() for s in ctx.sources]
    return ctx.text


@pytest.mark.parametrize("spelling", ["file", "input_file"])
def test_a_pdf_part_becomes_its_best_pages_in_the_prompt(client, spelling):
    pdf = DATA / "shared-mime-info-spec.pdf"
    with_file = _ask(client, [_file_part(pdf, spelling), {"type": "text", "text": QUESTION}])
    as_text = _ask(client, _expected_block(pdf, 2048) + "\n\n" + QUESTION)  # the tiny model's context
    assert with_file.usage.prompt_tokens == as_text.usage.prompt_tokens > 300


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("locked.pdf", lambda: (DATA / "encrypted.pdf").read_bytes(), "locked.pdf: the PDF is encrypted"),
        ("empty.pdf", lambda: b"", "empty.pdf: the file is empty (0 bytes)."),
        ("notes.bin", lambda: b"abc", "notes.bin: not a document this app reads"),
        ("bad.pdf", lambda: b"%PDF-1.4 garbage", "bad.pdf: not a PDF that can be read"),
    ],
)
def test_bad_files_are_a_400_naming_the_file_and_the_server_stays_up(client, name, make, message):
    part = {"type": "file", "file": {"filename": name, "file_data": base64.b64encode(make()).decode()}}
    with pytest.raises(openai.BadRequestError) as exc:
        _ask(client, [part, {"type": "text", "text": "hi"}])
    assert message in str(exc.value)
    assert _ask(client, "still there?").usage.prompt_tokens > 0


def test_a_file_id_is_refused_there_is_no_file_store(client):
    with pytest.raises(openai.BadRequestError, match="file_data"):
        _ask(client, [{"type": "file", "file": {"file_id": "file-abc"}}, {"type": "text", "text": "hi"}])
