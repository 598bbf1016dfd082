"""Anthropic's Messages API (POST /v1/messages), streamed or not, in the shapes the
official ``anthropic`` client reads: coding agents speak it."""

from __future__ import annotations

import json
from typing import Any

from engine.api import Generate, GenerationResult, TokenEvent
from engine.serve.common import (
    Reply,
    check_body,
    check_model,
    check_text_size,
    constraint,
    decode_base64,
    field,
    force_tool_call,
    generation_params,
    hidden_specials,
    message_texts,
    new_id,
    reasoning,
    run,
    session_key,
)
from engine.serve.http import ApiError, Handler


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise ApiError(400, f"{where} must be a string or a list of text blocks.")


def _image(block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise ApiError(
            400, "An image block needs source.type 'base64' and source.data; this server does not download files."
        )
    return {"type": "image", "image": decode_base64(source["data"], "image")}


def chat_messages(body: dict[str, Any], tool_format: Any) -> list[dict[str, Any]]:
    """Anthropic messages as the chat template's: tool_use blocks become the assistant's
    tool_calls, tool_result blocks become tool messages."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "'system'")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list.")
    as_text = bool(tool_format is not None and tool_format.arguments_as_text)
    for message in raw:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, "Each message needs a role: user or assistant.")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, "A message's content must be a string or a list of blocks.")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thinking = ""
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(block.get("text", ""))})
            elif kind == "image":
                parts.append(_image(block))
            elif kind == "tool_use" and role == "assistant":
                args = block.get("input") or {}
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": json.dumps(args) if as_text else args},
                    }
                )
            elif kind == "tool_result" and role == "user":
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": _text(block.get("content", ""), "A tool_result's content"),
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                thinking += str(block.get("thinking", ""))
            else:
                raise ApiError(400, f"Unknown content block type {kind!r} in a {role} message.")
        out.extend(results)  # tool results answer the previous turn's calls: they come first
        if parts or calls or not results:
            text_only = all(p["type"] == "text" for p in parts)
            turn: dict[str, Any] = {"role": role, "content": "".join(p["text"] for p in parts) if text_only else parts}
            if calls:
                turn["tool_calls"] = calls
            if thinking:
                turn["reasoning_content"] = thinking
            out.append(turn)
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(the tools for the template, the tools one of which must be called, if any)."""
    tools = field(body, "tools", list)
    choice = field(body, "tool_choice", dict) or {}
    if not tools or choice.get("type") == "none":
        return None, None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ApiError(400, "Each tool needs a name and an input_schema.")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
                },
            }
        )
    if choice.get("type") == "any":
        return out, out
    if choice.get("type") == "tool":
        named = [t for t in out if t["function"]["name"] == choice.get("name")]
        if not named:
            raise ApiError(400, f"tool_choice names {choice.get('name')!r}, which is not among the tools.")
        return out, named
    return out, None


def _stop_reason(result: GenerationResult, calls: bool, stop: str | None = None) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"


def matched_stop(backend: Any, result: GenerationResult, stops: list[str]) -> str | None:
    """Which of ``stops`` ended the reply, if one did: the reply stopped without writing
    an end-of-turn token, at the first place any stop sequence appears in what the model
    wrote (the decoded tokens, stop sequence included, which the reply's text leaves out)."""
    if result.finish_reason != "stop" or not stops or not result.token_ids:
        return None
    if result.token_ids[-1] in backend.host.eos_token_ids:
        return None
    written = backend.host.tokenizer.decode(result.token_ids)
    found = [(written.find(s), -len(s), s) for s in stops if s in written]
    return min(found)[2] if found else None


def _usage(result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "input_tokens": s.prompt_tokens - s.cached_tokens,
        "output_tokens": s.generated_tokens,
        "cache_read_input_tokens": s.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_block(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


def messages(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    field(body, "max_tokens", int, required=True)
    params = generation_params(body, backend, max_tokens_keys=("max_tokens",), stop_key="stop_sequences")
    output = field(body, "output_config", dict) or {}
    if isinstance(output.get("format"), dict):
        params.constraint = constraint(output["format"], "output_config.format")
    effort = output.get("effort") if isinstance(output.get("effort"), str) else None
    params.reasoning = reasoning(backend, {"xhigh": "high", "max": "high"}.get(effort or "", effort))
    thinking = field(body, "thinking", dict)
    control = backend.info.reasoning_control
    if thinking is not None and control is not None and control.is_switch:
        params.reasoning = thinking.get("type") != "disabled"
    tools, forced = _tools(body)
    if forced:
        force_tool_call(params, backend, forced)
    msgs = chat_messages(body, backend.tool_format)
    check_text_size(backend, message_texts(msgs))
    stream = field(body, "stream", bool, False)
    command = Generate(backend.session(session_key(msgs)), msgs, params, tools=tools)
    reply = Reply(hidden_specials(body, backend))
    mid = new_id("msg_")

    if not stream:
        result = run(handler, command, reply.feed)
        reply.finish()
        stop = matched_stop(backend, result, params.stop_strings)
        content: list[dict[str, Any]] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": "".join(reply.reasoning), "signature": ""})
        if reply.text:
            content.append({"type": "text", "text": "".join(reply.text)})
        content.extend(_tool_block(c) for c in reply.calls)
        handler.send_json(
            200,
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": _stop_reason(result, bool(reply.calls), stop),
                "stop_sequence": stop,
                "usage": _usage(result),
            },
        )
        return

    state = {"index": -1, "kind": None}

    def event(name: str, payload: dict[str, Any]) -> None:
        handler.send_event({"type": name, **payload}, name)

    def start() -> None:
        if handler.streaming:
            return
        event(
            "message_start",
            {
                "message": {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                }
            },
        )

    def close_block() -> None:
        if state["kind"] is not None:
            event("content_block_stop", {"index": state["index"]})
            state["kind"] = None

    def open_block(kind: str, block: dict[str, Any]) -> None:
        close_block()
        state["index"] += 1
        state["kind"] = kind
        event("content_block_start", {"index": state["index"], "content_block": block})

    def send(items: list[tuple[str, Any]]) -> None:
        for kind, value in items:
            if kind == "tool":
                block = _tool_block(value)
                open_block("tool", {**block, "input": {}})
                event(
                    "content_block_delta",
                    {
                        "index": state["index"],
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                )
                close_block()
            elif kind == "reasoning":
                if state["kind"] != "thinking":
                    open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                event(
                    "content_block_delta",
                    {"index": state["index"], "delta": {"type": "thinking_delta", "thinking": value}},
                )
            else:
                if state["kind"] != "text":
                    open_block("text", {"type": "text", "text": ""})
                event("content_block_delta", {"index": state["index"], "delta": {"type": "text_delta", "text": value}})

    def on_token(ev: TokenEvent) -> None:
        start()
        send(reply.feed(ev))

    result = run(handler, command, on_token)
    start()
    send(reply.finish())
    close_block()
    stop = matched_stop(backend, result, params.stop_strings)
    event(
        "message_delta",
        {
            "delta": {"stop_reason": _stop_reason(result, bool(reply.calls), stop), "stop_sequence": stop},
            "usage": _usage(result),
        },
    )
    event("message_stop", {})


def count_tokens(handler: Handler, body: Any) -> None:
    """POST /v1/messages/count_tokens: the prompt tokens a /v1/messages request with these
    messages, system and tools would read (as the chat template writes them; an image
    counts as its placeholder here, while generating it takes the tokens its size needs)."""
    backend = handler.server.backend
    body = check_body(body)
    check_model(body, backend)
    msgs = chat_messages(body, backend.tool_format)
    check_text_size(backend, message_texts(msgs))
    tools, _ = _tools(body)
    template = backend.host.template
    if template is None:
        raise ApiError(400, "This model has no chat template, so it takes no messages; send a plain prompt instead.")
    text = template.render(msgs, tools=tools, add_generation_prompt=True)
    ids = backend.host.tokenizer.encode(text, add_special_tokens=False)
    handler.send_json(200, {"input_tokens": len(ids)})
