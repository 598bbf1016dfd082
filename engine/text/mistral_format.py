"""Mistral's instruct format, for model folders that ship tekken.json and no Jinja template.

mistral-common builds these prompts in code rather than with a template. It first merges
neighbouring messages of one role (their text joined by a blank line) and then lays out:

    <s>[SYSTEM_PROMPT]sys[/SYSTEM_PROMPT][INST]user[/INST]answer</s>[INST]user[/INST]

From format v7 on, each system message stands where it was, between its own markers.
Before (v3, Mistral Nemo) the system prompts, joined by a blank line, open the last user
message instead. An audio part becomes ``[BEGIN_AUDIO][AUDIO]``; the media layer widens
[AUDIO] to the clip's length. Text in a user turn is encoded piece by piece between those
markers, which is what encoding the rendered text does too, since special tokens split it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import TemplateError

_BLANK = "\n\n"
_AUDIO = "[BEGIN_AUDIO][AUDIO]"


def _parts(content: Any) -> list[str | None]:
    """Text pieces of a message, None for an audio part; neighbouring text already joined."""
    if content is None or isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise TemplateError(f"A message's content must be text or a list of parts, got {type(content).__name__}.")
    out: list[str | None] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text = part.get("text") or ""
            if not text:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += _BLANK + text
            else:
                out.append(text)
        elif kind in ("audio", "input_audio"):
            out.append(None)
        else:
            raise TemplateError(
                f"Mistral's instruct format here takes text and audio parts only, not {kind!r}; "
                "give the model a chat template that handles it."
            )
    return out


def _merge(messages: list[Mapping[str, Any]]) -> list[tuple[str, list[str | None]]]:
    """Neighbouring messages of one role made one, as mistral-common's normaliser does."""
    merged: list[tuple[str, list[str | None]]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"Each chat message must be an object with a role, got {message!r}.")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise TemplateError(
                f"Mistral's instruct format here takes system, user and assistant messages, not {role!r}."
            )
        parts = _parts(message.get("content"))
        if merged and merged[-1][0] == role and role != "system":
            prev = merged[-1][1]
            if prev and parts and isinstance(prev[-1], str) and isinstance(parts[0], str):
                prev[-1] += _BLANK + parts[0]
                parts = parts[1:]
            prev.extend(parts)
        else:
            merged.append((role, parts))
    return merged


def _render_parts(parts: list[str | None]) -> str:
    return "".join(_AUDIO if p is None else p for p in parts)


class MistralFormat:
    """Renders a conversation as mistral-common's ``encode_chat_completion`` lays it out.

    ``version`` is tekken.json's ``config.version`` ("v3", "v7", "v11", "v13").
    """

    is_fallback = False
    source = ""  # no Jinja source: nothing to detect reasoning markers in

    def __init__(self, version: str, bos_token: str = "<s>", eos_token: str = "</s>"):
        if version in ("v1", "v2"):
            raise TemplateError(
                f"Mistral's instruct format {version} is not supported; give the model a chat template."
            )
        self.version = version
        self.system_in_place = version not in ("v3",)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **_: Any,
    ) -> str:
        """The prompt text; the model answers right after the last ``[/INST]``."""
        if tools:
            raise TemplateError("Tool calling in Mistral's instruct format is not supported yet; send no tools.")
        if not messages:
            raise TemplateError("The conversation is empty: give the chat at least one message.")
        merged = _merge(list(messages))
        has_audio = any(p is None for _, parts in merged for p in parts)
        if has_audio and any(role == "system" for role, _ in merged):
            raise TemplateError("Mistral's audio models take no system prompt together with audio; drop one.")
        if not self.system_in_place:
            system = _BLANK.join(_render_parts(parts) for role, parts in merged if role == "system")
            merged = [m for m in merged if m[0] != "system"]
        # Like mistral-common: v3 needs a user turn first; later formats only a non-empty chat.
        if not merged or (not self.system_in_place and merged[0][0] != "user"):
            merged.insert(0, ("user", []))
        last_user = max((i for i, (role, _) in enumerate(merged) if role == "user"), default=-1)
        out = [self.bos_token]
        for i, (role, parts) in enumerate(merged):
            if role == "system":
                out.append(f"[SYSTEM_PROMPT]{_render_parts(parts)}[/SYSTEM_PROMPT]")
            elif role == "user":
                body = _render_parts(parts)
                if not self.system_in_place and i == last_user and system:
                    body = system + _BLANK + body
                out.append(f"[INST]{body}[/INST]")
            else:
                text = _render_parts(parts).rstrip(" ")
                if not text:
                    raise TemplateError("An assistant message in the conversation is empty.")
                out.append(text + self.eos_token)
        return "".join(out)
