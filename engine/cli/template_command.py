"""``python -m engine template``: render a chat template from files, print exactly the result.

The contract (DESIGN.md, "Engine CLI"): stdout gets the rendered text and nothing else;
any failure prints one line on stderr and exits non-zero, without a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

from engine.errors import EngineError, TemplateError
from engine.files import MESSAGES_LIMIT, TEMPLATE_LIMIT, read_text_bounded
from engine.text.chat_template import ChatTemplate, load_template


def _read_messages(path: Path) -> tuple[list, list | None]:
    try:
        data = json.loads(read_text_bounded(path, MESSAGES_LIMIT, "a conversation", TemplateError))
    except FileNotFoundError:
        raise TemplateError(f"Messages file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"Cannot read messages file {path}: {' '.join(str(exc).split())}") from None
    except json.JSONDecodeError as exc:
        raise TemplateError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("messages"), list):
        raise TemplateError(f'{path} must hold an object like {{"messages": [...], "tools": [...] | null}}.')
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise TemplateError(f'"tools" in {path} must be a list or null.')
    return data["messages"], tools


def _config_special_tokens(path: Path) -> dict[str, str]:
    """A tokenizer_config.json also names the special tokens its template expects."""
    if path.suffix.lower() != ".json":
        return {}
    try:
        config = json.loads(read_text_bounded(path, TEMPLATE_LIMIT, "a chat template", TemplateError))
    except (OSError, ValueError):
        return {}
    found = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name) if isinstance(config, Mapping) else None
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def run_template_command(
    template_path: str | Path,
    messages_path: str | Path,
    add_generation_prompt: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> int:
    """Render and print; returns the process exit status (0, or 1 with a line on stderr)."""
    try:
        template_path, messages_path = Path(template_path), Path(messages_path)
        source = load_template(template_path)
        special = _config_special_tokens(template_path)
        if bos_token is not None:
            special["bos_token"] = bos_token
        if eos_token is not None:
            special["eos_token"] = eos_token
        messages, tools = _read_messages(messages_path)
        text = ChatTemplate(source, special).render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    except EngineError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    out = sys.stdout
    out.flush()
    buffer = getattr(out, "buffer", None)
    if buffer is not None:  # bytes, so the console's encoding cannot alter the text
        buffer.write(text.encode("utf-8"))
        buffer.flush()
    else:
        out.write(text)
        out.flush()
    return 0
