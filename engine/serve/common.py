"""What the OpenAI and Anthropic endpoints share: field checks, generation parameters,
media from data: URLs, running one generation on the worker, and the reply split into
reasoning, text and tool calls as it streams."""

from __future__ import annotations

import base64
import binascii
import copy
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from engine.api import DoneEvent, ErrorEvent, GenerationParams, GenerationResult, TokenEvent, ToolCall
from engine.serve.http import ApiError, engine_error

DEFAULT_MAX_TOKENS = 4096
MAX_CHOICES = 16  # n: replies per request (each one generation)
_MISSING = object()


def field(
    body: Mapping[str, Any], key: str, types: type | tuple[type, ...], default: Any = None, *, required: bool = False
) -> Any:
    """``body[key]`` when it has the right type; 400 naming the field otherwise."""
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise ApiError(400, f"'{key}' is required.", param=key)
        return default
    if isinstance(types, type):
        types = (types,)
    # JSON has no int/float split and bool is an int in Python: be exact about both.
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in types:
        raise ApiError(400, f"'{key}' must be {_names(types)}, not a boolean.", param=key)
    if not isinstance(value, types):
        raise ApiError(400, f"'{key}' must be {_names(types)}.", param=key)
    return value


def _names(types: tuple[type, ...]) -> str:
    words = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(words.get(t, t.__name__) for t in types)


def check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def check_model(body: Mapping[str, Any], backend: Any) -> str:
    """The model the request names: the loaded one, by its id or its path (404 otherwise)."""
    info = backend.require_model()
    name = field(body, "model", str, required=True)
    if name not in (info.name, info.path, backend.model_arg or info.name):
        raise ApiError(
            404,
            f"The model '{name}' does not exist here; this server runs '{info.name}'.",
            param="model",
            code="model_not_found",
        )
    return info.name


def generation_params(
    body: Mapping[str, Any], backend: Any, *, max_tokens_keys: tuple[str, ...], stop_key: str
) -> GenerationParams:
    """Sampling and stopping from the request, the model's generation_config.json for the rest."""
    params = copy.deepcopy(backend.default_params) if backend.default_params is not None else GenerationParams()
    params.max_tokens = DEFAULT_MAX_TOKENS
    for key in max_tokens_keys:
        value = field(body, key, int)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{key}' must be at least 1.", param=key)
            params.max_tokens = value
    sampling = params.sampling
    for key in ("temperature", "top_p"):
        value = field(body, key, float)
        if value is not None:
            setattr(sampling, key, value)
    top_k = field(body, "top_k", int)
    if top_k is not None:
        sampling.top_k = top_k
    sampling.seed = field(body, "seed", int)
    if sampling.temperature < 0 or sampling.temperature > 2:
        raise ApiError(400, "'temperature' must be between 0 and 2.", param="temperature")
    if not 0 < sampling.top_p <= 1:
        raise ApiError(400, "'top_p' must be in (0, 1].", param="top_p")
    if sampling.top_k < 0:
        raise ApiError(400, "'top_k' must be at least 0.", param="top_k")
    stop = field(body, stop_key, (str, list))
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise ApiError(400, f"'{stop_key}' must be a string or a list of up to 16 strings.", param=stop_key)
    params.stop_strings = [s for s in stops if s]
    return params


def constraint(fmt: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A structured-output request as GenerationParams.constraint: json_object,
    json_schema (``schema``) or, beyond OpenAI's API, regex (``pattern``)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, f"A json_schema {key} needs its schema (an object).", param=key)
        return {"type": "json_schema", "schema": fmt["schema"]}
    if kind == "regex":
        if not isinstance(fmt.get("pattern"), str):
            raise ApiError(400, f"A regex {key} needs a 'pattern' string.", param=key)
        return {"type": "regex", "pattern": fmt["pattern"]}
    raise ApiError(400, f"Unknown {key} type {kind!r}: use json_object, json_schema or regex.", param=key)


def reasoning(backend: Any, effort: str | None) -> bool | str | None:
    """A request's reasoning effort as the template's switch: an effort for templates that
    take one (gpt-oss), on/off for the others ("none" and "minimal" turn it off)."""
    control = backend.info.reasoning_control if backend.info is not None else None
    if effort is None or control is None:
        return None
    if control.is_switch:
        return effort not in ("none", "minimal")
    if effort in control.choices:
        return effort
    raise ApiError(
        400,
        f"This model's reasoning effort is one of {', '.join(map(str, control.choices))}.",
        param="reasoning_effort",
    )


def force_tool_call(params: GenerationParams, backend: Any, tools: list[dict[str, Any]] | None) -> None:
    """``tool_choice`` "required" or a named tool: constrain the reply to one call, written in
    the model's own markers, to one of ``tools``. Formats without a plain-JSON call (and
    models without a known format) are left to choose, as with "auto"."""
    from engine.text.tool_calls import forced_call

    fmt = backend.tool_format
    forced = forced_call(fmt, tools or []) if fmt is not None else None
    if forced is None:
        return
    if params.constraint is not None:
        raise ApiError(
            400, "A structured response format and a required tool call cannot be combined.", param="tool_choice"
        )
    params.constraint = forced


def decode_data_url(url: str, what: str) -> bytes:
    """The bytes of a ``data:...;base64,...`` URL; the server never fetches web addresses."""
    if not url.startswith("data:"):
        raise ApiError(400, f"The {what} must be a data: URL (base64); this server does not download files.")
    head, sep, data = url.partition(",")
    if not sep or ";base64" not in head:
        raise ApiError(400, f"The {what} data: URL must be base64-encoded.")
    return decode_base64(data, what)


def decode_base64(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"The {what} is not valid base64.") from None


def session_key(messages: list[dict[str, Any]] | str | list[int]) -> str:
    """What identifies a conversation across its requests: how it starts (its messages up
    to the first user message, or a plain prompt's first characters). Each turn of a chat
    resends those, so every turn lands on the session whose cache holds its prefix."""
    if isinstance(messages, str):
        return "text:" + messages[:200]
    if messages and isinstance(messages[0], int):
        return "ids:" + ",".join(map(str, messages[:64]))
    head = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", f"<{p.get('type')}>") for p in content)
        head.append(f"{message.get('role')}:{content}")
        if message.get("role") == "user":
            break
    return "chat:" + "\x00".join(head)


def check_text_size(backend: Any, texts: Any) -> None:
    """Refuse, before anything is tokenized, text that cannot fit the model's context: more
    characters than the context's tokens could hold even if each were the vocabulary's
    longest token. Tokenizing a huge text costs seconds on the engine's thread, which every
    other request waits behind."""
    info = backend.info
    advice = getattr(info, "context_advice", None)
    limit = (advice.limit if advice is not None else 0) or getattr(info, "context_length", 0)
    chars = sum(len(t) for t in texts)
    longest = backend.longest_token_chars()
    if limit and longest and chars > limit * longest:
        raise ApiError(
            400,
            f"The prompt is {chars:,} characters, more than the model's context of {limit:,} tokens can hold; shorten it.",
            code="context_length_exceeded",
        )


def message_texts(messages: list[dict[str, Any]]) -> Any:
    """The text in chat messages (string contents and text parts)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def without_specials(text: str, hidden: frozenset[str]) -> str:
    """``text`` without the literal special tokens in ``hidden`` (a model that writes
    ``<|endoftext|>`` mid-reply); a special token's text comes whole in one piece."""
    for token in hidden:
        if token in text:
            text = text.replace(token, "")
    return text


def hidden_specials(body: Mapping[str, Any], backend: Any) -> frozenset[str]:
    """The special tokens a reply leaves out: all of them, unless ``skip_special_tokens``
    is false (vLLM's name for asking to see them)."""
    return backend.special_texts() if field(body, "skip_special_tokens", bool, True) else frozenset()


def choice_count(body: Mapping[str, Any]) -> int:
    """``n``: how many replies to write for each prompt (1 to MAX_CHOICES)."""
    n = field(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_CHOICES}.", param="n")
    return n


def choice_params(params: GenerationParams, j: int) -> GenerationParams:
    """The settings of the ``j``-th of n replies: a seeded request gives each reply its own
    seed (seed + j), so the n differ yet the request stays reproducible."""
    if j == 0 or params.sampling.seed is None:
        return params
    out = copy.deepcopy(params)
    out.sampling.seed = params.sampling.seed + j
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def run(handler: Any, command: Any, on_token: Callable[[TokenEvent], None]) -> GenerationResult:
    """Submit ``command`` and wait for its result, handing each TokenEvent on. A client
    that goes away cancels the generation (ClientGone ends the request)."""
    backend = handler.server.backend
    rid = backend.submit(command)
    finished = False
    try:
        for event in backend.events(rid, handler.client_gone):
            if isinstance(event, TokenEvent):
                on_token(event)  # a write to a closed connection raises ClientGone here
            elif isinstance(event, ErrorEvent):
                finished = True
                raise engine_error(event.kind, event.message)
            elif isinstance(event, DoneEvent):
                finished = True
                result = event.result
                if getattr(result, "finish_reason", None) == "error":  # (embeddings have none)
                    raise ApiError(500, result.error or "The generation failed.", "server_error")
                return result
    finally:
        if not finished:  # the client went away (or the handler failed): stop generating for it
            backend.cancel(rid)
    raise ApiError(500, "The generation ended without a result.", "server_error")


class Reply:
    """The reply as it streams: ``feed`` a TokenEvent, get ``(kind, value)`` items, kind
    "reasoning" / "text" (strings) or "tool" (a ToolCall: the engine puts a request's calls
    on their own channel when it offered tools); ``finish`` flushes."""

    def __init__(self, hidden: frozenset[str] = frozenset()):
        self.hidden = hidden  # literal special tokens kept out of the text (see without_specials)
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, event: TokenEvent) -> list[tuple[str, Any]]:
        if event.channel == "reasoning":
            self.reasoning.append(event.text)
            return [("reasoning", event.text)] if event.text else []
        if event.channel == "tool" and event.tool_call is not None:
            self.calls.append(event.tool_call)
            return [("tool", event.tool_call)]
        if event.text and (text := without_specials(event.text, self.hidden)):
            self.text.append(text)
            return [("text", text)]
        return []

    def finish(self) -> list[tuple[str, Any]]:
        return []  # nothing is held here: the engine's stream ends with the reply's last text
