"""The reasoning switch of real chat templates: found from the Jinja source, rendered as
transformers renders it with the switch unset, off and on (or at each effort), and carried
by GenerationParams.reasoning into the prompt a model really receives.

Goldens: tests/golden/reasoning/switch_renders.json, made by
tests/golden/make_reasoning_goldens.py from the templates in ../shared/data/chat_templates.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from engine.api import GenerationParams, ReasoningControl
from engine.errors import TemplateError
from engine.text import chat_template
from engine.text.chat_template import ChatTemplate, load_template
from engine.text.reasoning_switch import find_reasoning_control, reasoning_variables, switch_variable

GOLDEN = json.loads(
    (Path(__file__).resolve().parents[2] / "golden" / "reasoning" / "switch_renders.json").read_text(encoding="utf-8")
)
TEMPLATES = GOLDEN["templates"]

# What each template does with the variable left undefined (read from its source).
DEFAULTS = {
    "llama.cpp/Qwen-Qwen3-0.6B.jinja": True,
    "llama.cpp-2026/Qwen3.5-4B.jinja": True,
    "llama.cpp/deepseek-ai-DeepSeek-V3.1.jinja": False,
    "llama.cpp-2026/deepseek-ai-DeepSeek-V3.2.jinja": False,
    "llama.cpp-2026/HuggingFaceTB-SmolLM3-3B.jinja": True,
    "llama.cpp-2026/GLM-4.6.jinja": True,
    "mistral.rs/smollm3.jinja": True,
    "llama.cpp/openai-gpt-oss-120b.jinja": "medium",
}

WITHOUT_SWITCH = [
    "llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "chujiezheng/llama-3-instruct.jinja",
    "llama.cpp/Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama.cpp/Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "llama.cpp-2026/Kimi-K2-Instruct.jinja",
]


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch):
    now = datetime.fromisoformat(GOLDEN["now"])
    monkeypatch.setattr(chat_template, "clock", lambda: now)


def _template(shared_data: Path, rel: str) -> ChatTemplate:
    return ChatTemplate(load_template(shared_data / "chat_templates" / rel), GOLDEN["special_tokens"])


@pytest.mark.parametrize("rel", list(TEMPLATES))
def test_each_real_template_names_its_switch_and_default(shared_data, rel):
    control = find_reasoning_control(_template(shared_data, rel))
    entry = TEMPLATES[rel]
    assert control == ReasoningControl(entry["variable"], tuple(entry["choices"]), DEFAULTS[rel])
    assert control.is_switch == (entry["variable"] != "reasoning_effort")


@pytest.mark.parametrize("rel", WITHOUT_SWITCH)
def test_templates_without_a_switch_report_none(shared_data, rel):
    template = _template(shared_data, rel)
    assert find_reasoning_control(template) is None
    # A chat saved under a reasoning model keeps its choice; here it changes nothing.
    messages = GOLDEN["conversations"]["one_question"]
    assert template.render(messages, add_generation_prompt=True, **reasoning_variables(None, False)) == template.render(
        messages, add_generation_prompt=True
    )


def test_detection_reads_jinja_not_text():
    # Prose, a message field and a variable the template sets itself are no switch.
    assert switch_variable("{# enable_thinking #}{{ 'thinking' }}{{ messages[0].thinking }}") is None
    assert switch_variable("{% set enable_thinking = true %}{{ enable_thinking }}") is None
    assert switch_variable("{% if enable_thinking is defined %}x{% endif %}") == "enable_thinking"
    assert switch_variable("{{ reasoning_effort | default('medium') }}") == "reasoning_effort"
    assert switch_variable("{% if %}") is None  # broken Jinja: compiling reports it


@pytest.mark.parametrize("rel", list(TEMPLATES))
def test_renders_match_transformers_for_every_choice(shared_data, rel):
    template = _template(shared_data, rel)
    control = find_reasoning_control(template)
    mismatches = []
    for case in TEMPLATES[rel]["renders"]:
        messages = GOLDEN["conversations"][case["conversation"]]
        got = template.render(messages, add_generation_prompt=True, **reasoning_variables(control, case["choice"]))
        if got != case["output"]:
            mismatches.append(
                f"{case['conversation']} / {case['choice']!r}:\n{got}\n--- transformers\n{case['output']}"
            )
    assert not mismatches, "\n".join(mismatches)
    # The switch matters: each choice renders differently from the others somewhere.
    by_choice = {}
    for case in TEMPLATES[rel]["renders"]:
        by_choice.setdefault(json.dumps(case["choice"]), []).append(case["output"])
    assert len({tuple(v) for k, v in by_choice.items() if k != "null"}) == len(TEMPLATES[rel]["choices"])


def test_a_choice_of_the_wrong_kind_is_refused_in_one_line():
    switch = ReasoningControl("enable_thinking", (False, True), True)
    effort = ReasoningControl("reasoning_effort", ("low", "medium", "high"), "medium")
    assert reasoning_variables(switch, False) == {"enable_thinking": False}
    assert reasoning_variables(effort, "high") == {"reasoning_effort": "high"}
    assert reasoning_variables(switch, None) == {}
    for control, bad in ((switch, "high"), (switch, 1), (effort, True), (effort, "extreme")):
        with pytest.raises(TemplateError) as info:
            reasoning_variables(control, bad)
        assert "\n" not in str(info.value) and control.variable in str(info.value)


# ---- through the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_host(tmp_path_factory, shared_data):
    """A tiny llama whose tokenizer_config carries the real Qwen3 template."""
    from engine.runtime.host import ModelHost
    from tests.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-qwen3-template")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (shared_data / "chat_templates" / "llama.cpp/Qwen-Qwen3-0.6B.jinja").read_text()
    config_path.write_text(json.dumps(config))
    host = ModelHost()
    host.load(str(folder))
    return host


def test_the_choice_reaches_the_prompt_and_the_cache_keeps_only_what_agrees(qwen3_host):
    host = qwen3_host
    assert host.info.reasoning_control == ReasoningControl("enable_thinking", (False, True), True)
    messages = [{"role": "user", "content": "hello there"}]
    params = GenerationParams(max_tokens=1, ignore_eos=True)
    unset = host.generate("s", messages, params)
    on = host.generate("s", messages, GenerationParams(max_tokens=1, ignore_eos=True, reasoning=True))
    off = host.generate("s", messages, GenerationParams(max_tokens=1, ignore_eos=True, reasoning=False))
    # Off appends an empty think block to the generation prompt; on equals the default.
    off_text = host.template.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert off_text.endswith("<think>\n\n</think>\n\n")
    assert off.stats.prompt_tokens == len(host.session("s").encode_rendered(off_text))
    assert on.stats.prompt_tokens == unset.stats.prompt_tokens < off.stats.prompt_tokens
    # Switching reuses the shared prefix only; the switched-off tail is prefilled anew.
    assert on.stats.cached_tokens == unset.stats.prompt_tokens - 1
    assert off.stats.cached_tokens <= on.stats.prompt_tokens
    again_on = host.generate("s", messages, GenerationParams(max_tokens=1, ignore_eos=True, reasoning=True))
    assert again_on.stats.prompt_tokens == on.stats.prompt_tokens
    with pytest.raises(TemplateError):
        host.generate("s", messages, GenerationParams(max_tokens=1, reasoning="high"))


def test_the_cli_takes_the_switch(qwen3_host):
    """`generate --chat --thinking off` renders Qwen3's empty think block; a choice the
    template cannot take is one line and a non-zero exit."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    folder = qwen3_host.info.path

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "engine",
                "generate",
                "--model",
                folder,
                "--chat",
                "--prompt",
                "hello there",
                "--max-tokens",
                "1",
                "--temp",
                "0",
                "--json",
                *flags,
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def prompt_tokens(*flags: str) -> int:
        proc = run(*flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])["prompt_tokens"]

    assert prompt_tokens("--thinking", "off") > prompt_tokens("--thinking", "on") == prompt_tokens()
    refused = run("--thinking", "high")
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
