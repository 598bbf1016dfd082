"""Chat template rules that the goldens do not spell out one by one."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from engine.errors import TemplateError
from engine.text import chat_template
from engine.text.chat_template import ChatTemplate, load_template

USER = [{"role": "user", "content": "hi"}]


def render(source: str, messages=USER, **kwargs) -> str:
    return ChatTemplate(source).render(messages, **kwargs)


def test_strftime_now_reads_the_clock_hook(monkeypatch):
    monkeypatch.setattr(chat_template, "clock", lambda: datetime(2024, 7, 26, 8, 5))
    assert render("{{ strftime_now('%d %B %Y %H:%M') }}") == "26 July 2024 08:05"


def test_generation_block_passes_through():
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render(source) == "[hi]"


def test_loop_controls_and_trimming():
    source = "{% for i in range(5) %}\n  {% if i == 3 %}{% break %}{% endif %}\n{{ i }}\n{% endfor %}"
    assert render(source) == "0\n1\n2\n"


def test_tojson_options():
    value = {"b": "é<>", "a": [1, 2]}
    assert render("{{ x | tojson }}", x=value) == json.dumps(value, ensure_ascii=False)
    assert render("{{ x | tojson(indent=2, sort_keys=True) }}", x=value) == json.dumps(
        value, ensure_ascii=False, indent=2, sort_keys=True
    )
    assert render("{{ x | tojson(separators=(',', ':')) }}", x=value) == '{"b":"é<>","a":[1,2]}'


def test_special_tokens_and_kwargs_override():
    template = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}", {"bos_token": "<s>", "eos_token": "</s>"}
    )
    assert template.render(USER, enable_thinking=False) == "<s>|</s>|False"
    assert template.render(USER, eos_token="<|eot|>") == "<s>|<|eot|>|"


def test_none_fields_are_dropped_and_reasoning_is_aliased():
    source = "{% for m in messages %}{{ m.content is defined }}/{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}"
    messages = [{"role": "assistant", "content": None, "reasoning": "why"}]
    assert render(source, messages) == "False/why/why;"


def test_documents_and_tools_are_visible():
    source = "{{ tools[0].name }} {{ documents[0].title }}"
    assert render(source, tools=[{"name": "f"}], documents=[{"title": "Doc", "text": "t"}]) == "f Doc"


def test_sandbox_refuses_unsafe_access():
    with pytest.raises(TemplateError):
        render("{{ messages.__class__.__mro__ }}x{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(TemplateError, match="underscore"):
        render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(TemplateError, match="unsafe"):
        render("{% set l = [] %}{{ l.append(1) }}")


def test_errors_are_one_line_template_errors():
    with pytest.raises(TemplateError, match="syntax error at line 2") as err:
        ChatTemplate("ok\n{% for %}")
    assert "\n" not in str(err.value)
    with pytest.raises(TemplateError, match="refused the conversation: bad\\s+role") as err:
        render("{{ raise_exception('bad\\n role') }}")
    assert "\n" not in str(err.value)
    with pytest.raises(TemplateError, match="empty"):
        render("x", messages=[])
    with pytest.raises(TemplateError, match="failed on this conversation: can only concatenate") as err:
        render("{{ messages[0].content + 1 }}")
    assert "TypeError" not in str(err.value)  # words, never a Python class name


def test_rich_values_become_placeholders():
    class Image:
        def save(self, path):  # a method a template must never reach
            raise AssertionError("called")

    messages = [{"role": "user", "content": [{"type": "image", "image": Image()}]}]
    assert render("{{ messages[0].content[0].image }}", messages) == "<Image>"


def test_load_template_forms(tmp_path):
    (tmp_path / "a.jinja").write_text("J", encoding="utf-8")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "C"}), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}),
        encoding="utf-8",
    )
    assert [load_template(tmp_path / n) for n in ("a.jinja", "chat_template.json", "tokenizer_config.json")] == [
        "J",
        "C",
        "D",
    ]
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "rag", "template": "R"}]}), encoding="utf-8"
    )
    with pytest.raises(TemplateError, match="none is named 'default'"):
        load_template(tmp_path / "tokenizer_config.json")
