"""The reasoning switch a chat template offers, found by reading its Jinja source.

Reasoning models take a template variable that turns thinking on or off (Qwen3,
SmolLM3, GLM: ``enable_thinking``; DeepSeek V3.1/V3.2, Granite 3.3: ``thinking``) or
sets its effort (gpt-oss: ``reasoning_effort``). A template offers a switch when it
reads one of these known variables without setting it first: Jinja's own analysis
(``meta.find_undeclared_variables``) says so, where a substring search would also fire
on prose and on message fields such as ``message.thinking``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from engine.api import ReasoningControl
from engine.errors import TemplateError
from engine.text.chat_template import template_environment

ON_OFF: tuple[bool, ...] = (False, True)
EFFORTS: tuple[str, ...] = ("low", "medium", "high")

# In order of preference: DeepSeek V3.2 reads ``thinking`` and falls back to
# ``enable_thinking``; its own name comes first.
KNOWN_SWITCHES: tuple[tuple[str, tuple[bool | str, ...]], ...] = (
    ("thinking", ON_OFF),
    ("enable_thinking", ON_OFF),
    ("reasoning_effort", EFFORTS),
)

# A one-turn conversation that every chat template accepts; rendering it with and
# without the variable tells which choice is the template's default.
_PROBE = [{"role": "user", "content": "Hello"}]


@lru_cache(maxsize=32)
def switch_variable(source: str) -> str | None:
    """The known reasoning variable ``source`` reads but never defines itself, or None."""
    if not source:
        return None
    try:
        free = jinja2.meta.find_undeclared_variables(template_environment().parse(source))
    except jinja2.TemplateSyntaxError:
        return None  # compiling the template reports the error itself
    return next((name for name, _ in KNOWN_SWITCHES if name in free), None)


def find_reasoning_control(template: Any) -> ReasoningControl | None:
    """The switch a ChatTemplate offers, with the choice it renders by default; None for
    templates without one (and for base models' plain-text prompts)."""
    variable = switch_variable(getattr(template, "source", "") or "")
    if variable is None:
        return None
    choices = dict(KNOWN_SWITCHES)[variable]
    return ReasoningControl(variable=variable, choices=choices, default=_default_choice(template, variable, choices))


def _default_choice(template: Any, variable: str, choices: tuple[bool | str, ...]) -> bool | str | None:
    try:
        unset = template.render(_PROBE, add_generation_prompt=True)
        for choice in choices:
            if template.render(_PROBE, add_generation_prompt=True, **{variable: choice}) == unset:
                return choice
    except TemplateError:
        pass
    return None


def reasoning_variables(control: ReasoningControl | None, choice: bool | str | None) -> dict[str, Any]:
    """The template variables that carry ``choice`` (GenerationParams.reasoning): nothing for
    None or a template without a switch; TemplateError for a choice the switch cannot take."""
    if choice is None or control is None:
        return {}
    if choice not in control.choices or type(choice) is not type(control.choices[0]):
        wanted = "on or off (true/false)" if control.is_switch else ", ".join(map(str, control.choices))
        raise TemplateError(
            f"This model's chat template takes {control.variable} = {wanted}, not {choice!r}; "
            "pick one of those or leave it unset for the model's default."
        )
    return {control.variable: choice}
