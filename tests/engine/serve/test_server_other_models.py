"""The server on models other than the tiny chat model: a real SentencePiece model
(stories260K, whose token texts must keep their leading space) and a sentence embedding
model (chat to it is a 400 naming what it does, the engine stays, and a huge input is
cut before the engine tokenizes it)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from .conftest import start_server

HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0}


def test_sentencepiece_token_texts_join_to_the_text(shared_data, tmp_path):
    """A real SentencePiece model (stories260K): each token's text keeps its leading space."""
    srv = start_server(shared_data / "tiny_llm" / "stories260K.gguf", tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120) as c:
            out = c.completions.create(
                model="stories260K", prompt="Once upon a time", max_tokens=12, logprobs=1, **GREEDY
            )
            chat_free = out.choices[0]
        assert " " in chat_free.text and "".join(chat_free.logprobs.tokens) == chat_free.text
        assert any(t.startswith(" ") for t in chat_free.logprobs.tokens)
    finally:
        srv.stop()


GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "embeddings"


def test_chat_to_an_embedding_model_is_a_400_and_the_engine_stays(tmp_path):
    srv = start_server(GOLDEN / "qwen3_embedding", tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120) as c:
            for call in (
                lambda: c.chat.completions.create(model="qwen3_embedding", messages=HELLO, max_tokens=2),
                lambda: c.completions.create(model="qwen3_embedding", prompt="hi", max_tokens=2),
                lambda: c.completions.create(model="qwen3_embedding", prompt="hi", max_tokens=0, echo=True, logprobs=1),
            ):
                with pytest.raises(openai.BadRequestError) as e:
                    call()
                assert "sentence embedding model" in e.value.message and "/v1/embeddings" in e.value.message
            with pytest.raises(openai.BadRequestError) as e:
                c.embeddings.create(model="qwen3_embedding", input=[10**9])
            assert "outside this model's vocabulary" in e.value.message
            # A text far past the model's 24-token limit: cut before it is tokenized, yet the
            # vector is the one of its first tokens, as for any text past the limit.
            text = "the quick brown fox jumps over the lazy dog " * 25_000
            started = time.monotonic()
            huge = c.embeddings.create(model="qwen3_embedding", input=text, encoding_format="float")
            took = time.monotonic() - started
            head = c.embeddings.create(model="qwen3_embedding", input=text[:2000], encoding_format="float")
        assert took < 10 and huge.usage.prompt_tokens == head.usage.prompt_tokens
        assert np.allclose(huge.data[0].embedding, head.data[0].embedding, atol=1e-6)
        with urllib.request.urlopen(srv.base + "/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
    finally:
        srv.stop()
