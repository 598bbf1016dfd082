"""An embedding model beside the chat model in the worker: loaded within what the chat
model's budget leaves, embedding as the model does alone, the chat model untouched;
one that does not fit, or a chat model offered as the embedder, refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.api import DoneEvent, Embed, ErrorEvent, Generate, GenerationParams, LoadEmbedder, LoadModel
from engine.runtime.host import ModelHost
from engine.runtime.worker import EngineWorker
from tests.engine.runtime.test_worker import HELLO, Events

EMBEDDER = Path(__file__).resolve().parents[2] / "golden" / "embeddings" / "qwen3_embedding"
TEXTS = ["the magic file starts with a magic string", "glob weights go up to 100"]


@pytest.fixture()
def worker():
    events = Events()
    w = EngineWorker(events)
    w.start()
    yield w, events
    assert w.shutdown(10)


def _ok(ev, rid):
    done = ev.end_of(rid)
    assert isinstance(done, DoneEvent), done
    return done.result


def test_embedder_beside_the_chat_model(worker, tiny_model_dir):
    w, ev = worker
    chat = _ok(ev, w.submit(LoadModel(str(tiny_model_dir))))
    embedder = _ok(ev, w.submit(LoadEmbedder(str(EMBEDDER))))
    assert embedder.embedding_dimensions and chat.embedding_dimensions is None
    vectors = _ok(ev, w.submit(Embed(TEXTS, beside=True))).vectors
    alone = ModelHost()
    alone.load(str(EMBEDDER))
    for got, want in zip(vectors, alone.embed(TEXTS).vectors, strict=True):
        assert np.allclose(got, want, atol=1e-6)
    # The chat model still answers, between two embedding requests.
    reply = _ok(ev, w.submit(Generate("c", HELLO, GenerationParams(max_tokens=3, ignore_eos=True))))
    assert len(reply.token_ids) == 3
    assert _ok(ev, w.submit(LoadEmbedder(None))) is None
    error = ev.end_of(w.submit(Embed(TEXTS, beside=True)))
    assert isinstance(error, ErrorEvent) and "No embedding model is loaded beside the chat model" in error.message


def test_a_chat_model_is_not_an_embedder(worker, tiny_model_dir):
    w, ev = worker
    _ok(ev, w.submit(LoadModel(str(tiny_model_dir))))
    error = ev.end_of(w.submit(LoadEmbedder(str(tiny_model_dir))))
    assert isinstance(error, ErrorEvent) and "not a sentence embedding model" in error.message


def test_an_embedder_that_does_not_fit_beside_the_chat_model_is_refused(worker, tiny_model_dir):
    w, ev = worker
    weights = _ok(ev, w.submit(LoadModel(str(tiny_model_dir)))).plan.weights_bytes
    # Room for the chat model and some KV, not for the embedder's ~230 KB of weights too.
    _ok(ev, w.submit(LoadModel(str(tiny_model_dir), memory_budget=weights + 100_000)))
    error = ev.end_of(w.submit(LoadEmbedder(str(EMBEDDER))))
    assert isinstance(error, ErrorEvent), error
    assert error.message.startswith("qwen3_embedding needs ") and "\n" not in error.message
    assert "beside tiny-llama the memory budget has 100.0 KB left: pick a smaller embedding model" in error.message
    # The chat model is still loaded and answers.
    reply = _ok(ev, w.submit(Generate("c", HELLO, GenerationParams(max_tokens=2, ignore_eos=True))))
    assert len(reply.token_ids) == 2
