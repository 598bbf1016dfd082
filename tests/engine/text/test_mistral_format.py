"""Mistral's instruct format against mistral-common's ``encode_chat_completion``.

tests/golden/make_tekken_goldens.py recorded the ids of several conversations (system +
user, multi-turn, several text parts, neighbouring user messages, audio chunks of
jfk.wav once and three times over) under instruct formats v3, v7 and v11, on the small
tekken.json and on the Voxtral one. Here the conversation is rendered, each [AUDIO]
widened to the clip's token count (375 per 30 s chunk, as the media layer does) and
encoded; the ids must be the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import TemplateError
from engine.runtime.assembly import load_template as _load_template
from engine.text.chat_template import ChatTemplate
from engine.text.mistral_format import MistralFormat
from engine.text.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "tekken"
VECTORS = json.loads((GOLDEN / "vectors.json").read_text(encoding="utf-8"))
AUDIO_TOKENS = {"jfk": 375, "jfk_x3": 750}
FILES = {"main": "tekken.json", "voxtral": "voxtral_tekken.json"}


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {label: Tokenizer.from_tekken(GOLDEN / name) for label, name in FILES.items()}


def widen(text: str, clips: list[str]) -> str:
    head, *rest = text.split("[AUDIO]")
    assert len(rest) == len(clips)
    return head + "".join("[AUDIO]" * AUDIO_TOKENS[c] + tail for c, tail in zip(clips, rest))


@pytest.mark.parametrize("key", sorted(VECTORS["chats"]))
def test_conversations_encode_as_mistral_common(toks, key):
    label, version, _ = key.split("/")
    case = VECTORS["chats"][key]
    text = MistralFormat(version).render(case["messages"], add_generation_prompt=True)
    assert toks[label].encode(widen(text, case["audio"]), add_special_tokens=False) == case["ids"]


def test_the_cases_cover_system_placement_audio_and_every_version():
    keys = set(VECTORS["chats"])
    assert {
        "main/v3/system_multi_turn",
        "main/v7/system_multi_turn",
        "main/v11/system_multi_turn",
        "voxtral/v7/audio",
        "voxtral/v7/audio_multi_turn",
        "voxtral/v11/audio",
    } <= keys
    ids = VECTORS["chats"]["main/v7/system_multi_turn"]["ids"]
    v3 = VECTORS["chats"]["main/v3/system_multi_turn"]["ids"]
    assert ids[:2] == [1, 17] and 17 not in v3  # v7 keeps [SYSTEM_PROMPT]; v3 folds it into the last turn


def test_refusals_are_one_readable_line():
    fmt = MistralFormat("v7")
    audio = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    cases = [
        (dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]), "Tool calling"),
        (dict(messages=[{"role": "user", "content": [{"type": "image"}]}]), "text and audio parts"),
        (dict(messages=[{"role": "system", "content": "s"}, *audio]), "no system prompt together with audio"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "system, user and assistant"),
        (dict(messages=[]), "empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(TemplateError, match=message):
            fmt.render(**kwargs)
    with pytest.raises(TemplateError, match="not supported"):
        MistralFormat("v2")


def test_the_host_uses_it_only_without_a_jinja_template(tmp_path, toks):
    assert isinstance(_load_template(toks["main"]), MistralFormat)
    (tmp_path / "tekken.json").write_bytes((GOLDEN / "tekken.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    template = _load_template(Tokenizer.from_dir(tmp_path))
    assert isinstance(template, ChatTemplate)
    assert template.render([{"role": "user", "content": "x"}]) == "<s>x"
