"""Chat templates rendered the way Hugging Face transformers renders them.

A model's chat template is untrusted Jinja that ships with the model, so it runs in
Jinja's immutable sandbox. Everything the template can see is rebuilt from plain
JSON-like values first, and the environment carries exactly the functions that
transformers' ``apply_chat_template`` offers (``raise_exception``, ``strftime_now``, a
``tojson`` that does not HTML-escape, the ``{% generation %}`` block, loop controls),
so a template renders here character for character as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TemplateError
from engine.files import TEMPLATE_LIMIT, read_text_bounded
from engine.text.template_limits import GuardedSandbox, compile_guarded, render_limited

# Names a message's reasoning may arrive under; templates read the first one
# (gpt-oss templates read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Where strftime_now() reads the time. Tests pin it to a fixed date.
clock: Callable[[], datetime] = datetime.now


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---- the Jinja environment -------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers uses the block to find assistant tokens for training masks; for
    inference the body is all that matters.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want raw JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return clock().strftime(fmt)


class _SafeDict:
    """``dict(...)`` inside a template, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (a route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace's signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
            )


def template_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment chat templates compile in (also used to analyse them)."""
    env = GuardedSandbox(  # the immutable sandbox with time and size limits
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return compile_guarded(template_environment(), source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"The chat template has a syntax error at line {exc.lineno}: {_one_line(exc.message or exc)}. "
            "Fix the template or pass another one."
        ) from None


# ---- what the template sees -------------------------------------------------


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON-like types; anything else becomes ``"<TypeName>"``.

    Rich objects (arrays, images) carry methods the sandbox does not know to be unsafe.
    Templates only test media keys for presence, so a placeholder renders the same.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy / mlx scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TemplateError("The conversation is empty: give the chat template at least one message.")
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"Each chat message must be an object with a role, got {message!r}.")
        # APIs often send content=None or tool_calls=None; templates handle a missing key better.
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


class ChatTemplate:
    """A compiled chat template. ``render`` gives the prompt text, nothing tokenized."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str) or not source:
            raise TemplateError("The chat template is empty. Give the model a chat template or pick another model.")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Mapping[str, Any]] | None = None,
        documents: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages``; extra keyword arguments (``enable_thinking``, ``bos_token``...)
        become template variables and override the special tokens given at construction."""
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TemplateError("Each tool must be a JSON schema object.")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TemplateError("Each document must be an object with 'title' and 'text'.")
        variables = _plain({**self.special_tokens, **kwargs})
        try:
            return render_limited(
                self._template,
                messages=_prepare_messages(messages),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(
                f"The chat template refused the conversation: {_one_line(exc.message or exc)}"
            ) from None
        except Exception as exc:  # a template bug (bad index, wrong type) surfaces as any Python error
            raise TemplateError(f"The chat template failed on this conversation: {_one_line(exc)}") from None


# ---- finding the template --------------------------------------------------


def pick_template(value: Any, origin: str) -> str:
    """The template text from a ``chat_template`` entry: a string, or a list of
    ``{"name", "template"}`` entries of which the one named "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TemplateError(f"{origin} lists chat templates {sorted(map(str, named))} but none is named 'default'.")
    raise TemplateError(f"{origin} has no chat_template.")


def load_template(path: str | Path) -> str:
    """Template text from a ``.jinja`` file, a ``chat_template.json`` or a ``tokenizer_config.json``."""
    path = Path(path)
    try:
        text = read_text_bounded(path, TEMPLATE_LIMIT, "a chat template", TemplateError)
    except FileNotFoundError:
        raise TemplateError(f"Template file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"Cannot read template file {path}: {_one_line(exc)}") from None
    if path.suffix.lower() != ".json":
        return text
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TemplateError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(data, Mapping) or "chat_template" not in data:
        raise TemplateError(f"{path} has no 'chat_template' entry; pass a .jinja file or a tokenizer_config.json.")
    return pick_template(data["chat_template"], str(path))


class PlainTextTemplate:
    """The prompt for a base model that ships no chat template (stories260K, raw
    pretrained checkpoints): the conversation as one running document.

    A base model only knows how to continue text, so role labels it was never
    trained on would only derail it. User and system turns start new paragraphs;
    an assistant turn was generated as a continuation, so it follows directly.
    """

    is_fallback = True
    source = ""  # no Jinja source: nothing to detect reasoning markers in

    def __init__(self, bos_token: str | None = None):
        self.bos_token = bos_token or ""

    def render(self, messages: list[Mapping[str, Any]], **_: Any) -> str:
        text = ""
        for message in messages:
            content = _text_of(message.get("content"))
            if text and message.get("role") != "assistant":
                text += "\n\n"
            text += content
        return self.bos_token + text


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: only the text parts mean anything here
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)
