"""Sentence embeddings with the loaded embedding model: each text tokenized and truncated
as sentence-transformers does (or a list of ids, truncated alike), one vector each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.api import Embeddings, ModelInfo
from engine.errors import EngineError, WrongModelKind
from engine.runtime.request_errors import Cancelled


def embed(
    model: Any,
    tokenizer: Any,
    info: ModelInfo,
    inputs: Sequence[str | Sequence[int]],
    cancel: threading.Event | None = None,
    check_ids: Callable[[Sequence[int]], list[int]] = list,
) -> Embeddings:
    """Embed each of ``inputs``; a chat model is refused, naming the families that embed, and
    ids given as they are pass ``check_ids`` (the host refuses those outside the vocabulary)."""
    from engine.models.embedder import embedding_families

    if info.embedding_dimensions is None:
        raise WrongModelKind(
            f"{info.name} is a chat model, not a sentence embedding model. Load an embedding model "
            f"(a sentence-transformers folder) of one of the families that embed: {embedding_families()}."
        )
    import mlx.core as mx

    # sentence-transformers' limit, else the model's own context (an unlimited text would not fit)
    limit = model.spec.max_seq_length or getattr(model.args, "max_position_embeddings", None)
    vectors, tokens = [], 0
    for item in inputs:
        if cancel is not None and cancel.is_set():
            raise Cancelled("The embedding request was cancelled.")
        ids = tokenizer.encode_truncated(item, limit) if isinstance(item, str) else check_ids(item)[:limit]
        if not ids:
            raise EngineError("An input to embed is empty; give at least one token.")
        vector = model(ids)
        mx.eval(vector)
        vectors.append(vector.tolist())
        tokens += len(ids)
    return Embeddings(vectors, tokens)
