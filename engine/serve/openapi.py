"""GET /openapi.json: an OpenAPI 3.1 description of this server's endpoints, so generic
clients and API testers (schemathesis) can read what it takes. The request schemas name
the fields the server reads, with their types and bounds; fields beyond them are allowed
(clients send many that do not change the answer), and the answers' schemas give the
shapes the official clients parse."""

from __future__ import annotations

from typing import Any

from engine.serve.http import Handler

_STR, _INT, _NUM, _BOOL, _OBJ = (
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "object"},
)
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 16}]}

_SAMPLING = {
    "model": _STR,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "seed": _INT,
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "skip_special_tokens": _BOOL,
}

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _OBJ}, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _OBJ},
        "tool_call_id": _STR,
    },
    "required": ["role"],
}

_SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "ChatRequest": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1},
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "stop": _STOP,
            "logprobs": _BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "response_format": _OBJ,
            "tools": {"type": "array", "items": _OBJ},
            "tool_choice": {"oneOf": [_STR, _OBJ]},
            "reasoning_effort": _STR,
        },
        "required": ["model", "messages"],
    },
    "ChatMessage": _MESSAGE,
    "CompletionRequest": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    _TOKEN_IDS,
                    {
                        "type": "array",
                        "items": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                        "minItems": 1,
                        "maxItems": 256,
                    },
                ]
            },
            "max_tokens": {"type": "integer", "minimum": 0},
            "echo": _BOOL,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "best_of": {"type": "integer", "minimum": 1},
            "stop": _STOP,
        },
        "required": ["model", "prompt"],
    },
    "EmbeddingRequest": {
        "type": "object",
        "properties": {
            "model": _STR,
            "input": {"oneOf": [_STR, {"type": "array", "items": {"oneOf": [_STR, _INT, _TOKEN_IDS]}, "minItems": 1}]},
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
        },
        "required": ["model", "input"],
    },
    "DecideRequest": {
        "type": "object",
        "properties": {
            "model": _STR,
            "prompt": {"oneOf": [_STR, _TOKEN_IDS]},
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "candidates": {
                "type": "array",
                "items": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                "minItems": 1,
                "maxItems": 256,
            },
        },
        "required": ["candidates"],
    },
    "Decision": {
        "type": "object",
        "properties": {
            "object": {"const": "decision"},
            "model": _STR,
            "candidates": {"type": "array"},
            "logprobs": {"type": "array", "items": _NUM},
            "probabilities": {"type": "array", "items": _NUM},
            "candidate_ids": {"type": "array", "items": {"type": "array", "items": _INT}},
            "usage": {"type": "object", "properties": {"prompt_tokens": _INT}},
        },
        "required": ["object", "candidates", "logprobs", "probabilities"],
    },
    "MessagesRequest": {
        "type": "object",
        "properties": {
            "model": _STR,
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "role": {"enum": ["user", "assistant"]},
                        "content": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
                    },
                    "required": ["role", "content"],
                },
                "minItems": 1,
            },
            "system": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
            "stop_sequences": {"type": "array", "items": _STR, "maxItems": 16},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stream": _BOOL,
            "tools": {"type": "array", "items": _OBJ},
            "tool_choice": _OBJ,
            "thinking": _OBJ,
        },
        "required": ["model", "max_tokens", "messages"],
    },
    "CountTokensRequest": {
        "type": "object",
        "properties": {
            "model": _STR,
            "messages": {"type": "array", "items": _OBJ, "minItems": 1},
            "system": {"oneOf": [_STR, {"type": "array"}]},
            "tools": {"type": "array"},
        },
        "required": ["model", "messages"],
    },
    "Model": {
        "type": "object",
        "properties": {
            "id": _STR,
            "object": _STR,
            "created": _INT,
            "owned_by": _STR,
            "type": _STR,
            "display_name": _STR,
            "created_at": _STR,
        },
        "required": ["id", "object", "type"],
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": _STR,
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
            "has_more": _BOOL,
            "first_id": _STR,
            "last_id": _STR,
        },
        "required": ["data"],
    },
    "Health": {
        "type": "object",
        "properties": {"status": _STR, "model": _STR, "decoding": _INT, "restarts": _INT},
        "required": ["status"],
    },
    "CountTokens": {"type": "object", "properties": {"input_tokens": _INT}, "required": ["input_tokens"]},
    "Answer": {
        "type": "object",
        "description": "The answer in the shape the official clients read (see their API references).",
    },
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(c): {
            "description": "An error, with a one-line message.",
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        for c in codes
    }


def _post(summary: str, request: str, answer: str = "Answer", streams: bool = True) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(answer)}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {"description": "The answer (server-sent events when streaming).", "content": content},
                **_errors(400, 401, 404, 408, 413, 415, 503),
            },
        }
    }


def _get(summary: str, answer: str, *codes: int) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": _ref(answer)}}},
                **_errors(*codes),
            },
        }
    }


def _with_model(schemas: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The request schemas with ``model`` limited to the names the loaded model answers to."""
    out = {}
    for key, schema in schemas.items():
        props = schema.get("properties", {})
        if "model" in props and key.endswith("Request"):
            schema = {**schema, "properties": {**props, "model": {"type": "string", "enum": names}}}
        out[key] = schema
    return out


def spec(model_names: list[str] | None = None) -> dict[str, Any]:
    """The document; with ``model_names`` (the loaded model's id and path) the requests'
    ``model`` takes only those, as the server does."""
    model_get = _get("The loaded model, by its id.", "Model", 401, 404, 503)
    model_get["get"]["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": _STR}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mlx-desk engine server",
            "version": "1",
            "description": "OpenAI- and Anthropic-compatible endpoints over the loaded model.",
        },
        "servers": [{"url": "/"}],
        "components": {
            "schemas": _with_model(_SCHEMAS, model_names) if model_names else _SCHEMAS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
        "paths": {
            "/health": _get(
                "Whether the model is loaded and the engine running (503 while loading or stopped).", "Health", 503
            ),
            "/v1/models": _get("The loaded model, as OpenAI and Anthropic list models.", "ModelList", 401, 503),
            "/v1/models/{model_id}": model_get,
            "/v1/chat/completions": _post("OpenAI chat completion.", "ChatRequest"),
            "/v1/completions": _post(
                "OpenAI text completion (echo, logprobs, batches of prompts).", "CompletionRequest"
            ),
            "/v1/embeddings": _post(
                "OpenAI embeddings (sentence embedding models).", "EmbeddingRequest", streams=False
            ),
            "/v1/messages": _post("Anthropic Messages.", "MessagesRequest"),
            "/v1/decide": _post(
                "Decision scoring: each candidate's log-probability after the prompt, and their softmax.",
                "DecideRequest",
                "Decision",
                streams=False,
            ),
            "/v1/messages/count_tokens": _post(
                "Anthropic token count of a Messages request.", "CountTokensRequest", "CountTokens", streams=False
            ),
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {
                        "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": _OBJ}}}
                    },
                }
            },
        },
    }


def document(handler: Handler, _: Any) -> None:
    backend = handler.server.backend
    info = backend.info if backend.stopped is None else None
    names = sorted({info.name, info.path, backend.model_arg or info.name}) if info is not None else None
    handler.send_json(200, spec(names))
