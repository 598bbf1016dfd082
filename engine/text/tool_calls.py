"""Tool calls: find the calls a model writes in its own markers, while text streams.

Each family writes calls its own way, the way its chat template renders them back:

- Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; Qwen3-Coder
  puts ``<function=NAME><parameter=K>V</parameter></function>`` inside the same tags,
  GLM 4.5/4.6 ``NAME<arg_key>K</arg_key><arg_value>V</arg_value>``.
- Llama 3.x: the whole reply is ``{"name": ..., "parameters": {...}}`` (maybe after
  ``<|python_tag|>``).
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or from Small 3.2 on
  ``[TOOL_CALLS]NAME[ARGS]{...}``, to the end of the reply.
- gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.
- DeepSeek V3.x: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``.
- DeepSeek V3.2: ``<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter ...``.
- Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}...``.
- Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` with ``<|"|>`` around strings.

``detect_tool_format`` picks the format from the chat template's source; a
``ToolCallParser`` then turns streamed text into text pieces and ``ToolCall`` items. Text
that could still be the start of a call is held back; a block that does not parse is
handed back as the text it was, never dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.api import ToolCall
from engine.api import new_call_id as new_call_id  # the id shape lives with ToolCall in the api

Parsed = list[tuple[str, Any]]  # (name, arguments as a JSON value)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _scalar(text: str) -> Any:
    """A parameter value written bare: JSON when it reads as JSON, else the string itself."""
    value = _json(text)
    return text if value is None and text.strip() != "null" else value


def _named(obj: Any, *arg_keys: str) -> Parsed | None:
    """``{"name": ..., "arguments": {...}}`` objects (one or a list)."""
    items = obj if isinstance(obj, list) else [obj]
    out: Parsed = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = next((item[k] for k in arg_keys if k in item), {})
        if isinstance(args, str):
            args = _json(args)
        if not isinstance(args, dict):
            return None
        out.append((item["name"], args))
    return out or None


# ---- bodies, one parser per family ------------------------------------------------

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_ARG_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _parse_tag_body(body: str) -> Parsed | None:
    """Inside ``<tool_call>...</tool_call>``: JSON (Qwen, Hermes), ``<function=...>``
    (Qwen3-Coder) or ``NAME<arg_key>...`` (GLM)."""
    text = body.strip()
    if text.startswith("{"):
        return _named(_json(text), "arguments", "parameters")
    functions = _FUNCTION.findall(text)
    if functions:
        return [(name, {k: _scalar(v) for k, v in _PARAMETER.findall(inner)}) for name, inner in functions]
    name, _, rest = text.partition("<arg_key>")
    name = name.strip()
    if name and not re.search(r"\s", name) and "<" not in name:
        return [(name, {k.strip(): _scalar(v) for k, v in _ARG_PAIR.findall("<arg_key>" + rest if rest else "")})]
    return None


def _parse_llama(body: str) -> Parsed | None:
    text = body.removeprefix("<|python_tag|>").strip()
    parsed = _named(_json(text), "parameters", "arguments")
    if parsed is None and ";" in text:  # several calls, ";"-separated
        parts = [_named(_json(p), "parameters", "arguments") for p in text.split(";") if p.strip()]
        if parts and all(parts):
            parsed = [call for part in parts for call in part]  # type: ignore[union-attr]
    return parsed


def _parse_mistral(body: str) -> Parsed | None:
    chunks = [c.strip() for c in body.split("[TOOL_CALLS]") if c.strip()]
    out: Parsed = []
    for chunk in chunks:
        if chunk.startswith("["):  # v3: one JSON list of calls
            calls = _named(_json(chunk), "arguments")
        elif "[ARGS]" in chunk:  # v7+: NAME[ARGS]{...}, maybe NAME[CALL_ID]id[ARGS]
            head, _, args = chunk.partition("[ARGS]")
            name = head.partition("[CALL_ID]")[0].strip()
            value = _json(args)
            calls = [(name, value)] if name and isinstance(value, dict) else None
        else:
            calls = None
        if calls is None:
            return None
        out.extend(calls)
    return out or None


def _parse_harmony(body: str) -> Parsed | None:
    text = body.split("to=functions.", 1)[-1]
    head, sep, args = text.partition("<|message|>")
    name = re.split(r"\s|<\|", head.strip(), maxsplit=1)[0]
    value = _json(args.removesuffix("<|call|>").strip())
    if not sep or not name or not isinstance(value, dict):
        return None
    return [(name, value)]


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)


def _parse_deepseek(body: str) -> Parsed | None:
    out: Parsed = []
    for head, rest in _DEEPSEEK_CALL.findall(body):
        name, args = head.strip(), rest.strip()
        if name == "function" or "```" in args:  # R1: function<sep>NAME\n```json\n{...}\n```
            first, _, tail = args.partition("\n")
            name = first.strip() if name == "function" else name
            args = tail.strip().removeprefix("```json").removesuffix("```").strip()
        value = _json(args)
        if not name or not isinstance(value, dict):
            return None
        out.append((name, value))
    return out or None


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([^<\s]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
    r"(?:<\|tool_call_end\|>|$)",
    re.DOTALL,
)


def _parse_kimi(body: str) -> Parsed | None:
    out: Parsed = []
    for name, args in _KIMI_CALL.findall(body):
        value = _json(args.strip())
        if not isinstance(value, dict):
            return None
        out.append((name, value))
    return out or None


_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.DOTALL
)


def _parse_dsml(body: str) -> Parsed | None:
    """DeepSeek V3.2: invoke/parameter elements; string="false" values are JSON."""
    out: Parsed = []
    for name, inner in _DSML_INVOKE.findall(body):
        args: dict[str, Any] = {}
        for key, is_string, value in _DSML_PARAMETER.findall(inner):
            if is_string == "true":
                args[key] = value
            else:
                args[key] = _json(value)
                if args[key] is None and value.strip() != "null":
                    return None
        out.append((name, args))
    return out or None


_GEMMA_QUOTE = '<|"|>'


def _gemma_value(text: str, i: int) -> tuple[Any, int]:
    """One value of Gemma 4's call syntax at ``text[i]``: <|"|>string<|"|>, {k:v,...}, [..], bare."""
    if text.startswith(_GEMMA_QUOTE, i):
        end = text.index(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
        return text[i + len(_GEMMA_QUOTE) : end], end + len(_GEMMA_QUOTE)
    if text[i] == "{":
        obj: dict[str, Any] = {}
        i += 1
        while text[i] != "}":
            colon = text.index(":", i)
            key = text[i:colon].strip()
            obj[key], i = _gemma_value(text, colon + 1)
            if text[i] == ",":
                i += 1
        return obj, i + 1
    if text[i] == "[":
        items: list[Any] = []
        i += 1
        while text[i] != "]":
            value, i = _gemma_value(text, i)
            items.append(value)
            if text[i] == ",":
                i += 1
        return items, i + 1
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    return _scalar(text[i:end].strip()), end


def _parse_gemma(body: str) -> Parsed | None:
    text = body.removeprefix("<|tool_call>").removesuffix("<tool_call|>").strip()
    if not text.startswith("call:") or "{" not in text:
        return None
    name, brace = text[5 : text.index("{")], text.index("{")
    try:
        args, end = _gemma_value(text, brace)
    except (ValueError, IndexError):
        return None
    if not name or text[end:].strip():
        return None
    return [(name.strip(), args)]


# ---- formats ----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    starts: tuple[str, ...]  # markers that open a block of calls
    end: str | None  # closes it; None: the block runs to the end of the reply
    parse: Callable[[str], Parsed | None]  # the block, start marker included
    at_start_only: bool = False  # the block only counts at the very start of the reply
    # The template joins arguments as text (DeepSeek) rather than calling tojson on them.
    arguments_as_text: bool = False
    # How one call is written as plain JSON, for forcing a call with a grammar: (text
    # before, text after, the key of the arguments). None: the format has no such shape.
    json_call: tuple[str, str, str] | None = None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        "hermes",
        ("<tool_call>",),
        "</tool_call>",
        lambda b: _parse_tag_body(b.removeprefix("<tool_call>").removesuffix("</tool_call>")),
        json_call=("<tool_call>\n", "\n</tool_call>", "arguments"),
    ),
    "llama3": ToolCallFormat(
        "llama3", ("<|python_tag|>", "{"), None, _parse_llama, at_start_only=True, json_call=("", "", "parameters")
    ),
    "mistral": ToolCallFormat("mistral", ("[TOOL_CALLS]",), None, _parse_mistral),
    "harmony": ToolCallFormat(
        "harmony", ("<|channel|>commentary to=functions.", " to=functions."), "<|call|>", _parse_harmony
    ),
    "deepseek": ToolCallFormat(
        "deepseek", ("<｜tool▁calls▁begin｜>",), "<｜tool▁calls▁end｜>", _parse_deepseek, arguments_as_text=True
    ),
    "dsml": ToolCallFormat("dsml", ("<｜DSML｜function_calls>",), "</｜DSML｜function_calls>", _parse_dsml),
    "kimi": ToolCallFormat("kimi", ("<|tool_calls_section_begin|>",), "<|tool_calls_section_end|>", _parse_kimi),
    "gemma4": ToolCallFormat("gemma4", ("<|tool_call>",), "<tool_call|>", _parse_gemma),
}

# (signature in the template source, format), most specific first.
_SIGNATURES: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|call|>", "harmony"),  # gpt-oss: calls end with <|call|>
    ("tool▁calls▁begin", "deepseek"),
    ("｜DSML｜", "dsml"),
    ("<|tool_calls_section_begin|>", "kimi"),
    ("<|tool_call>", "gemma4"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3"),
    ('"parameters": ', "llama3"),  # Llama 3.2/3.3 describe the JSON call in prose
)


def detect_tool_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template renders (and so the model writes), if known."""
    source = chat_template or ""
    for signature, name in _SIGNATURES:
        if signature in source:
            return FORMATS[name]
    return None


def forced_call(fmt: ToolCallFormat, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A constraint (GenerationParams.constraint) whose every match is one call, in
    ``fmt``'s markers, to one of ``tools`` (OpenAI function entries) with arguments that
    match its schema; None when the format has no plain-JSON call to force."""
    if fmt.json_call is None or not tools:
        return None
    before, after, key = fmt.json_call
    options = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = dict(fn.get("parameters") or {"type": "object"})
        if "properties" in params:  # a call passes the parameters it declares, and no others
            params.setdefault("additionalProperties", False)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "json_schema", "schema": schema, "prefix": before, "suffix": after}


def to_tool_calls(parsed: Parsed) -> list[ToolCall]:
    return [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in parsed]


class ToolCallParser:
    """``feed(text)`` / ``flush()`` return text pieces (``str``) and ``ToolCall`` items,
    in the order the model wrote them."""

    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self._pending = ""  # text that may still begin a block
        self._block: str | None = None  # inside a block: its text so far, start marker included
        self._seen_text = False  # anything but whitespace emitted (at_start_only formats)
        self.calls: list[ToolCall] = []

    def _starts(self) -> tuple[str, ...]:
        if self.format.at_start_only and self._seen_text:
            return ()
        return self.format.starts

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self._block is not None:
            self._block += text
        else:
            self._pending += text
        while True:
            if self._block is not None:
                end = self.format.end
                if end is None or end not in self._block:
                    return out
                cut = self._block.index(end) + len(end)
                block, rest = self._block[:cut], self._block[cut:]
                self._block = None
                self._close(block, out)
                self._pending = rest
                continue
            starts = self._starts()
            text_now = self._pending
            if self.format.at_start_only and not self._seen_text:
                stripped = text_now.lstrip()
                hit = next((s for s in starts if stripped.startswith(s)), None)
                if hit is not None:
                    self._block, self._pending = stripped, ""
                    continue
                if stripped and not any(s.startswith(stripped) for s in starts):
                    self._seen_text = True
                    self._emit(out, text_now)
                    self._pending = ""
                return out
            hits = [(text_now.find(s), s) for s in starts]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, _ = min(hits, key=lambda h: (h[0], -len(h[1])))
                self._emit(out, text_now[:index])
                self._block, self._pending = text_now[index:], ""
                continue
            keep = 0
            for start in starts:
                for size in range(min(len(start) - 1, len(text_now)), keep, -1):
                    if start.startswith(text_now[-size:]):
                        keep = size
                        break
            self._emit(out, text_now[: len(text_now) - keep])
            self._pending = text_now[len(text_now) - keep :]
            return out

    def flush(self) -> list[str | ToolCall]:
        """The end of the reply: an open block is parsed as it stands (its end marker may be
        an end-of-turn token that never reaches the text)."""
        out: list[str | ToolCall] = []
        if self._block is not None:
            block, self._block = self._block, None
            self._close(block, out)
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _close(self, block: str, out: list[str | ToolCall]) -> None:
        parsed = self.format.parse(block)
        if parsed is None:
            self._emit(out, block)  # not a call after all: the text it was
            return
        calls = to_tool_calls(parsed)
        self.calls.extend(calls)
        out.extend(calls)

    def _emit(self, out: list[str | ToolCall], text: str) -> None:
        if not text:
            return
        if text.strip():
            self._seen_text = True
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: (its text without the calls, the calls)."""
    parser = fmt.parser()
    items = parser.feed(text) + parser.flush()
    return "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ToolCall)]
