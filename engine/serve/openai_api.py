"""OpenAI's endpoints: /v1/models, /v1/chat/completions and /v1/completions, streamed
(server-sent events) or not, in the shapes the official ``openai`` client reads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.api import Complete, Generate, GenerationParams, GenerationResult, TokenEvent
from engine.serve.common import (
    Reply,
    check_body,
    check_model,
    constraint,
    decode_base64,
    decode_data_url,
    field,
    force_tool_call,
    generation_params,
    new_id,
    now,
    reasoning,
    run,
    session_key,
)
from engine.serve.documents_api import FILE_PARTS, file_part, read_documents
from engine.serve.http import ApiError, Handler

MAX_TOP_LOGPROBS = 20


def models(handler: Handler, _: Any) -> None:
    info = handler.server.backend.require_model()
    handler.send_json(
        200,
        {"object": "list", "data": [{"id": info.name, "object": "model", "created": now(), "owned_by": "mlx-desk"}]},
    )


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


def _usage(result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    }


def _finish(result: GenerationResult, calls: bool) -> str:
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _token_entry(backend: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = backend.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _entry(backend: Any, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    return {**_token_entry(backend, token_id, logprob), "top_logprobs": [_token_entry(backend, t, v) for t, v in top]}


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
    if field(body, "n", int, 1) != 1:
        raise ApiError(400, "Only n=1 is supported.", param="n")
    params = generation_params(body, backend, max_tokens_keys=("max_tokens", "max_completion_tokens"), stop_key="stop")
    _logprob_settings(body, params, legacy=False)
    params.constraint = _response_format(body)
    params.reasoning = reasoning(backend, field(body, "reasoning_effort", str))
    tools, forced = _tools(body)
    if forced:
        force_tool_call(params, backend, forced)
    messages = chat_messages(body.get("messages"), backend.tool_format)
    read_documents(messages, backend.info.context_length if backend.info else 4096)
    stream = field(body, "stream", bool, False)
    include_usage = bool((field(body, "stream_options", dict) or {}).get("include_usage"))
    command = Generate(backend.session(session_key(messages)), messages, params, tools=tools)
    reply = Reply(backend.tool_format if tools else None)
    cid, created = new_id("chatcmpl-"), now()

    if not stream:
        result = run(handler, command, reply.feed)
        reply.finish()
        message: dict[str, Any] = {"role": "assistant", "content": "".join(reply.text) or (None if reply.calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = "".join(reply.reasoning)
        if reply.calls:
            message["tool_calls"] = [_call_json(c) for c in reply.calls]
        handler.send_json(
            200,
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": chat_logprobs(backend, result),
                        "finish_reason": _finish(result, bool(reply.calls)),
                    }
                ],
                "usage": _usage(result),
            },
        )
        return

    unsent: list[dict[str, Any]] = []  # log-prob entries of tokens no chunk has carried yet

    def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
        logprobs = {"content": list(unsent)} if unsent and (delta or finish) else None
        if logprobs is not None:
            unsent.clear()
        payload = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        handler.send_event(payload)

    def send(items: list[tuple[str, Any]]) -> None:
        for kind, value in items:
            if kind == "text":
                chunk({"content": value})
            elif kind == "reasoning":
                chunk({"reasoning_content": value})
            else:
                chunk({"tool_calls": [{"index": reply.calls.index(value), **_call_json(value)}]})

    def on_token(event: TokenEvent) -> None:
        if not handler.streaming:
            chunk({"role": "assistant", "content": ""})
        if event.logprobs is not None:
            tops = event.top_logprobs or [[] for _ in event.token_ids]
            unsent.extend(
                _entry(backend, t, lp, top) for t, lp, top in zip(event.token_ids, event.logprobs, tops, strict=False)
            )
        send(reply.feed(event))

    result = run(handler, command, on_token)
    if not handler.streaming:
        chunk({"role": "assistant", "content": ""})
    send(reply.finish())
    chunk({}, _finish(result, bool(reply.calls)))  # with the log-probs of tokens that wrote no text
    if include_usage:
        handler.send_event(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(result),
            }
        )
    handler.send_event("[DONE]")


def _call_json(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# ---- /v1/completions --------------------------------------------------------------------


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and i >= 0 for i in prompt):
        return prompt
    raise ApiError(
        400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request).", param="prompt"
    )


def _completion_logprobs(backend: Any, result: GenerationResult) -> dict[str, Any] | None:
    if result.token_logprobs is None:
        return None
    tokens = [backend.token_text(t) for t in result.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = result.top_logprobs
    return {
        "tokens": tokens,
        "token_logprobs": result.token_logprobs,
        "text_offset": offsets,
        "top_logprobs": [{backend.token_text(t): v for t, v in row} for row in tops] if tops else None,
    }


def completions(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    if field(body, "n", int, 1) != 1 or field(body, "best_of", int, 1) != 1:
        raise ApiError(400, "Only n=1 (and best_of=1) is supported.", param="n")
    if field(body, "echo", bool, False) or field(body, "suffix", str):
        raise ApiError(400, "'echo' and 'suffix' are not supported.", param="echo")
    params = generation_params(body, backend, max_tokens_keys=("max_tokens",), stop_key="stop")
    params.max_tokens = field(body, "max_tokens", int, 16)  # the completions API's own default
    if params.max_tokens < 1:
        raise ApiError(400, "'max_tokens' must be at least 1.", param="max_tokens")
    _logprob_settings(body, params, legacy=True)
    prompt = _prompt(body)
    stream = field(body, "stream", bool, False)
    include_usage = bool((field(body, "stream_options", dict) or {}).get("include_usage"))
    command = Complete(backend.session(session_key(prompt)), prompt, params)
    cid, created = new_id("cmpl-"), now()

    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> None:
        handler.send_event(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            }
        )

    if not stream:
        result = run(handler, command, lambda e: None)
        handler.send_json(
            200,
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": result.text,
                        "logprobs": _completion_logprobs(backend, result),
                        "finish_reason": _finish(result, False),
                    }
                ],
                "usage": _usage(result),
            },
        )
        return
    result = run(handler, command, lambda e: chunk(e.text) if e.text else None)
    chunk("", _finish(result, False), _completion_logprobs(backend, result))
    if include_usage:
        handler.send_event(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(result),
            }
        )
    handler.send_event("[DONE]")
