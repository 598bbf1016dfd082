"""POST /v1/embeddings through the official ``openai`` client, against the CLI server on
the tiny sentence-transformers goldens (tests/golden/make_embedding_goldens.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai
import pytest

from .conftest import API_KEY, post_raw, start_server

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "embeddings"


def _cosine_gap(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(1 - a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    srv = start_server(GOLDEN / "embeddinggemma", tmp_path_factory.mktemp("embed-log") / "server.log")
    yield srv
    srv.stop()


def test_openai_client_gets_sentence_transformers_vectors(gemma_server):
    expected = json.loads((GOLDEN / "embeddinggemma" / "expected.json").read_text())
    with openai.OpenAI(base_url=gemma_server.v1, api_key="none", max_retries=0) as client:
        # The client asks for base64 unless told otherwise; check both encodings.
        out = client.embeddings.create(model="embeddinggemma", input=expected["texts"])
        floats = client.embeddings.create(model="embeddinggemma", input=expected["texts"][0], encoding_format="float")
        ids = client.embeddings.create(model="embeddinggemma", input=expected["token_ids"][1])
    assert [d.index for d in out.data] == list(range(len(expected["texts"])))
    for got, want in zip(out.data, expected["embeddings"], strict=True):
        assert len(got.embedding) == expected["dimensions"]
        assert _cosine_gap(got.embedding, want) < 1e-6
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, expected["token_ids"]))
    assert _cosine_gap(floats.data[0].embedding, expected["embeddings"][0]) < 1e-6
    assert _cosine_gap(ids.data[0].embedding, expected["embeddings"][1]) < 1e-6
    assert out.model == "embeddinggemma"


def test_dimensions_keeps_the_first_numbers_renormalised(gemma_server):
    expected = json.loads((GOLDEN / "embeddinggemma" / "expected.json").read_text())
    with openai.OpenAI(base_url=gemma_server.v1, api_key="none", max_retries=0) as client:
        out = client.embeddings.create(model="embeddinggemma", input="the cat sat on the mat", dimensions=16)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="embeddinggemma", input="the cat", dimensions=49)
    vector = np.array(out.data[0].embedding)
    head = np.array(expected["embeddings"][0][:16])
    assert len(vector) == 16 and np.allclose(vector, head / np.linalg.norm(head), atol=1e-5)
    assert "between 1 and 48" in e.value.message


def test_bad_inputs_are_400s(gemma_server):
    for body in (
        {"model": "embeddinggemma", "input": ""},
        {"model": "embeddinggemma", "input": [[]]},
        {"model": "embeddinggemma", "input": [1.5]},
        {"model": "embeddinggemma", "input": "a", "encoding_format": "int8"},
    ):
        status, reply = post_raw(
            gemma_server.v1 + "/embeddings", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", (body, reply)


def test_an_embedding_model_refuses_chat(gemma_server):
    with (
        openai.OpenAI(base_url=gemma_server.v1, api_key="none", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as e,
    ):
        client.chat.completions.create(model="embeddinggemma", messages=[{"role": "user", "content": "hi"}])
    assert "sentence embedding model" in e.value.message and "/v1/embeddings" in e.value.message


def test_a_chat_model_asked_for_embeddings_names_the_families_that_embed(server):
    with (
        openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as e,
    ):
        client.embeddings.create(model=client.models.list().data[0].id, input="hello")
    assert "chat model" in e.value.message
    assert "qwen3 (Qwen3-Embedding)" in e.value.message and "gemma3_text (EmbeddingGemma)" in e.value.message
