"""OpenAI's POST /v1/embeddings over a loaded sentence embedding model.

``input`` is a string, a list of strings, a list of token ids or a list of such lists;
``encoding_format`` "float" (lists of numbers) or "base64" (little-endian float32 bytes,
which the official ``openai`` client asks for by default); ``dimensions`` keeps the first
N numbers and normalises them again (Matryoshka-trained models such as Qwen3-Embedding).
A chat model answers 400 naming the families that embed (the engine's own message).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from engine.api import Embed
from engine.serve.common import check_body, check_model, field, run
from engine.serve.http import ApiError, Handler

MAX_INPUTS = 2048  # OpenAI's own limit per request


def _inputs(raw: Any) -> list[str | list[int]]:
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raw = [raw]  # one input given as token ids
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a non-empty string, a list of strings, or token ids.", param="input")
    if len(raw) > MAX_INPUTS:
        raise ApiError(400, f"'input' holds {len(raw)} items; at most {MAX_INPUTS} per request.", param="input")
    out: list[str | list[int]] = []
    for item in raw:
        if isinstance(item, str) and item:
            out.append(item)
        elif (
            isinstance(item, list)
            and item
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in item)
        ):
            out.append(item)
        else:
            raise ApiError(
                400, "Each input must be a non-empty string or a non-empty list of token ids.", param="input"
            )
    return out


def _shortened(backend: Any, inputs: list[str | list[int]]) -> list[str | list[int]]:
    """Texts cut, before the engine tokenizes them, to twice the characters the model's
    context could hold even in its longest tokens: the engine truncates each input to the
    context anyway, and a huge text would cost seconds of tokenizing on the engine's
    thread, which every other request waits behind."""
    context = backend.require_model().context_length
    longest = backend.longest_token_chars()
    if not context or not longest:
        return inputs
    keep = 2 * context * longest
    return [item[:keep] if isinstance(item, str) else item for item in inputs]


def _shorten(vector: list[float], n: int) -> list[float]:
    head = vector[:n]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def embeddings(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    inputs = _inputs(body.get("input"))
    encoding = field(body, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be 'float' or 'base64'.", param="encoding_format")
    dimensions = field(body, "dimensions", int)
    full = backend.require_model().embedding_dimensions  # None: a chat model, which the engine refuses
    if dimensions is not None and full is not None and not 1 <= dimensions <= full:
        raise ApiError(400, f"'dimensions' must be between 1 and {full} for this model.", param="dimensions")
    inputs = _shortened(backend, inputs)
    result = run(handler, Embed(inputs), lambda event: None)
    data = []
    for i, vector in enumerate(result.vectors):
        if dimensions is not None and dimensions < len(vector):
            vector = _shorten(vector, dimensions)
        value: Any = vector
        if encoding == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": value})
    handler.send_json(
        200,
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        },
    )
