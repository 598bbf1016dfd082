"""OpenAI's endpoints: /v1/models, /v1/chat/completions and /v1/completions, streamed
(server-sent events) or not, in the shapes the official ``openai`` client reads."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from engine.api import Generate, GenerationParams, GenerationResult, TokenEvent
from engine.serve.common import (
    Reply,
    check_body,
    check_model,
    check_text_size,
    choice_count,
    choice_params,
    constraint,
    decode_base64,
    decode_data_url,
    field,
    force_tool_call,
    generation_params,
    hidden_specials,
    message_texts,
    new_id,
    now,
    reasoning,
    run,
    session_key,
)
from engine.serve.documents_api import FILE_PARTS, file_part, read_documents
from engine.serve.http import ApiError, Handler

MAX_TOP_LOGPROBS = 20


def model_entry(info: Any, created: int) -> dict[str, Any]:
    """The loaded model as both clients list it: OpenAI's id/object/created/owned_by and
    Anthropic's type/id/display_name/created_at (each client reads its own keys)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {
        "id": info.name,
        "object": "model",
        "created": created,
        "owned_by": "mlx-desk",
        "type": "model",
        "display_name": info.name,
        "created_at": stamp,
    }


def models(handler: Handler, _: Any) -> None:
    info = handler.server.backend.require_model()
    entry = model_entry(info, now())
    handler.send_json(
        200,
        {"object": "list", "data": [entry], "has_more": False, "first_id": entry["id"], "last_id": entry["id"]},
    )


def model(handler: Handler, _: Any) -> None:
    """GET /v1/models/{id}: the loaded model, by its id or path (404 for any other)."""
    backend = handler.server.backend
    info = backend.require_model()
    name = unquote(urlsplit(handler.path).path.rstrip("/").split("/v1/models/", 1)[1])
    if name not in (info.name, info.path, backend.model_arg or info.name):
        raise ApiError(
            404, f"The model '{name}' does not exist here; this server runs '{info.name}'.", code="model_not_found"
        )
    handler.send_json(200, model_entry(info, now()))


# ---- requests ----------------------------------------------------------------------


def _logprob_settings(body: Mapping[str, Any], params: GenerationParams, *, legacy: bool) -> None:
    if legacy:  # /v1/completions: "logprobs": N asks for the top N
        n = field(body, "logprobs", int)
        params.logprobs, params.top_logprobs = n is not None, n or 0
        key = "logprobs"
    else:
        params.logprobs = bool(field(body, "logprobs", bool, False))
        params.top_logprobs = field(body, "top_logprobs", int, 0)
        key = "top_logprobs"
        if params.top_logprobs and not params.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{key}' must be between 0 and {MAX_TOP_LOGPROBS}.", param=key)


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    fmt = field(body, "response_format", dict)
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        fmt = {"type": "json_schema", "schema": spec.get("schema") if isinstance(spec, dict) else None}
    return constraint(fmt, "response_format")


def _content(content: Any, role: str) -> Any:
    """OpenAI message content as the engine's: a string, or parts with media as bytes."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"A {role} message's content must be a string or a list of parts.", param="messages")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, "An image_url part needs image_url.url.", param="messages")
            parts.append({"type": "image", "image": decode_data_url(url, "image")})
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                raise ApiError(400, "An input_audio part needs input_audio.data (base64).", param="messages")
            parts.append({"type": "audio", "audio": decode_base64(audio["data"], "audio")})
        elif kind in FILE_PARTS and role == "user":
            parts.append(file_part(part))
        else:
            raise ApiError(
                400, f"Unknown content part type {kind!r}; use text, image_url, input_audio or file.", param="messages"
            )
    if all(p["type"] == "text" for p in parts):  # text-only templates expect a plain string
        return "".join(p["text"] for p in parts)
    return parts


def _tool_calls(calls: Any, as_text: bool) -> list[dict[str, Any]]:
    """An assistant turn's calls as chat templates read them: arguments as an object
    (transformers' convention), or as JSON text for the templates that join it as text."""
    if not isinstance(calls, list):
        raise ApiError(400, "'tool_calls' must be a list.", param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "Each tool call needs function.name.", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str) and not as_text:
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ApiError(
                    400, f"The arguments of the call to {fn['name']} are not JSON.", param="messages"
                ) from None
        elif not isinstance(args, str) and as_text:
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(raw: Any, tool_format: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list.", param="messages")
    as_text = bool(tool_format is not None and tool_format.arguments_as_text)
    out = []
    for message in raw:
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise ApiError(
                400, "Each message needs a role: system, developer, user, assistant or tool.", param="messages"
            )
        role = "system" if message["role"] == "developer" else message["role"]
        converted: dict[str, Any] = {"role": role, "content": _content(message.get("content"), role)}
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = _tool_calls(message["tool_calls"], as_text)
            if converted["content"] is None:
                converted["content"] = ""
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    converted[key] = message[key]
        if message.get("reasoning_content"):
            converted["reasoning_content"] = message["reasoning_content"]
        out.append(converted)
    return out


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(the tools for the template, the tools one of which must be called, if any)."""
    tools = field(body, "tools", list)
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None, None
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance((tool.get("function") or {}).get("name"), str):
            raise ApiError(400, "Each tool must be {'type': 'function', 'function': {'name': ...}}.", param="tools")
    if choice == "required":
        return tools, tools
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
        return tools, named
    return tools, None


# ---- responses -----------------------------------------------------------------------


def _usage(results: list[GenerationResult]) -> dict[str, Any]:
    """The request's usage over its n choices: the prompt once, every reply's tokens."""
    first = results[0].stats
    generated = sum(r.stats.generated_tokens for r in results)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _finish(result: GenerationResult, calls: bool) -> str:
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _token_entry(backend: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = backend.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _entry(backend: Any, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    """A token's log-prob entry; its alternatives best first, as the API lists them."""
    ranked = sorted(top, key=lambda pair: -pair[1])
    return {
        **_token_entry(backend, token_id, logprob),
        "top_logprobs": [_token_entry(backend, t, v) for t, v in ranked],
    }


def chat_logprobs(backend: Any, result: GenerationResult) -> dict[str, Any] | None:
    if result.token_logprobs is None:
        return None
    tops = result.top_logprobs or []
    return {
        "content": [
            _entry(backend, tid, lp, tops[i] if i < len(tops) else [])
            for i, (tid, lp) in enumerate(zip(result.token_ids, result.token_logprobs, strict=False))
        ]
    }


def chat_completions(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    n = choice_count(body)
    params = generation_params(body, backend, max_tokens_keys=("max_tokens", "max_completion_tokens"), stop_key="stop")
    _logprob_settings(body, params, legacy=False)
    params.constraint = _response_format(body)
    params.reasoning = reasoning(backend, field(body, "reasoning_effort", str))
    tools, forced = _tools(body)
    if forced:
        force_tool_call(params, backend, forced)
    messages = chat_messages(body.get("messages"), backend.tool_format)
    read_documents(messages, backend.info.context_length if backend.info else 4096)
    check_text_size(backend, message_texts(messages))
    stream = field(body, "stream", bool, False)
    include_usage = bool((field(body, "stream_options", dict) or {}).get("include_usage"))
    hidden = hidden_specials(body, backend)
    session = backend.session(session_key(messages))
    cid, created = new_id("chatcmpl-"), now()
    results: list[GenerationResult] = []
    choices: list[dict[str, Any]] = []
    for j in range(n):
        command = Generate(session, messages, choice_params(params, j), tools=tools)
        reply = Reply(hidden)
        if stream:
            results.append(_stream_choice(handler, command, reply, j, (cid, created, model, include_usage)))
            continue
        result = run(handler, command, reply.feed)
        reply.finish()
        results.append(result)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(reply.text) or (None if reply.calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = "".join(reply.reasoning)
        if reply.calls:
            message["tool_calls"] = [_call_json(c) for c in reply.calls]
        choices.append(
            {
                "index": j,
                "message": message,
                "logprobs": chat_logprobs(backend, result),
                "finish_reason": _finish(result, bool(reply.calls)),
            }
        )
    if not stream:
        handler.send_json(
            200,
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage(results),
            },
        )
        return
    if include_usage:
        handler.send_event(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(results),
            }
        )
    handler.send_event("[DONE]")


def _stream_choice(handler: Handler, command: Generate, reply: Reply, index: int, head: tuple) -> GenerationResult:
    """Stream one choice's chunks (its role first, its finish_reason last); its result."""
    backend = handler.server.backend
    cid, created, model, include_usage = head
    unsent: list[dict[str, Any]] = []  # log-prob entries of tokens no chunk has carried yet
    started = [False]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
        logprobs = {"content": list(unsent)} if unsent and (delta or finish) else None
        if logprobs is not None:
            unsent.clear()
        payload = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        handler.send_event(payload)

    def begin() -> None:
        if not started[0]:
            started[0] = True
            chunk({"role": "assistant", "content": ""})

    def send(items: list[tuple[str, Any]]) -> None:
        for kind, value in items:
            if kind == "text":
                chunk({"content": value})
            elif kind == "reasoning":
                chunk({"reasoning_content": value})
            else:
                chunk({"tool_calls": [{"index": reply.calls.index(value), **_call_json(value)}]})

    def on_token(event: TokenEvent) -> None:
        begin()
        if event.logprobs is not None:
            tops = event.top_logprobs or [[] for _ in event.token_ids]
            unsent.extend(
                _entry(backend, t, lp, top) for t, lp, top in zip(event.token_ids, event.logprobs, tops, strict=False)
            )
        send(reply.feed(event))

    result = run(handler, command, on_token)
    begin()
    send(reply.finish())
    chunk({}, _finish(result, bool(reply.calls)))  # with the log-probs of tokens that wrote no text
    return result


def _call_json(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
