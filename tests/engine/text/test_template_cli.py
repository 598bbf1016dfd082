"""The ``template`` command's contract: exact text on stdout, one-line errors on stderr."""

from __future__ import annotations

import json

import pytest

from engine.cli.template_command import run_template_command

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def files(tmp_path):
    def make(template: str, payload, name: str = "t.jinja"):
        t = tmp_path / name
        t.write_text(template, encoding="utf-8")
        m = tmp_path / "messages.json"
        m.write_text(payload if isinstance(payload, str) else json.dumps(payload), encoding="utf-8")
        return t, m

    return make


def test_prints_exactly_the_rendered_text(files, capsys):
    t, m = files(CHATML, {"messages": [{"role": "user", "content": "Grüß dich 👋"}], "tools": None})
    assert run_template_command(t, m, add_generation_prompt=True) == 0
    out, err = capsys.readouterr()
    assert out == "<|im_start|>user\nGrüß dich 👋<|im_end|>\n<|im_start|>assistant\n"
    assert err == ""


def test_bos_eos_and_tools_reach_the_template(files, capsys):
    template = "{{ bos_token }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages[0].content }}{{ eos_token }}"
    tool = {"type": "function", "function": {"name": "f", "description": "°C"}}
    t, m = files(template, {"messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    assert run_template_command(t, m, False, bos_token="<s>", eos_token="</s>") == 0
    assert capsys.readouterr().out == '<s>{"type": "function", "function": {"name": "f", "description": "°C"}}x</s>'


def test_tokenizer_config_brings_its_template_and_tokens(shared_data, tmp_path, capsys):
    m = tmp_path / "messages.json"
    m.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}), encoding="utf-8")
    config = shared_data / "chat_templates/tokenizer_configs/mistralai__Mistral-7B-Instruct-v0.3/tokenizer_config.json"
    assert run_template_command(config, m, False) == 0
    assert capsys.readouterr().out == "<s>[INST] Hi[/INST]"


def test_template_that_raises(files, capsys):
    t, m = files(
        "{{ raise_exception('Only user and assistant roles are supported!\\nReally.') }}",
        {"messages": [{"role": "system", "content": "s"}]},
    )
    assert run_template_command(t, m, False) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Only user and assistant roles are supported! Really." in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "template, payload, needle",
    [
        ("{% if %}", {"messages": []}, "syntax error at line 1"),
        (CHATML, "{oops", "not valid JSON"),
        (CHATML, {"msgs": []}, '"messages"'),
        (CHATML, {"messages": []}, "empty"),
        (CHATML, {"messages": [{"role": "user", "content": "x"}], "tools": "f"}, "tools"),
    ],
)
def test_bad_input_gives_one_line(files, capsys, template, payload, needle):
    t, m = files(template, payload)
    assert run_template_command(t, m, False) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_missing_files(tmp_path, capsys):
    assert run_template_command(tmp_path / "none.jinja", tmp_path / "m.json", False) == 1
    assert "Template file not found" in capsys.readouterr().err
    (tmp_path / "t.jinja").write_text("x", encoding="utf-8")
    assert run_template_command(tmp_path / "t.jinja", tmp_path / "m.json", False) == 1
    assert "Messages file not found" in capsys.readouterr().err


def test_template_json_without_chat_template(tmp_path, capsys):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}), encoding="utf-8")
    (tmp_path / "m.json").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}), encoding="utf-8")
    assert run_template_command(tmp_path / "tokenizer_config.json", tmp_path / "m.json", False) == 1
    assert "no 'chat_template'" in capsys.readouterr().err
