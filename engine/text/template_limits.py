"""Time and size limits for chat templates, which ship with models and are untrusted.

Jinja's sandbox stops a template from reaching the interpreter, not from running
forever or filling memory: nested 100,000-step loops hang, ``'x' * 2000000000`` takes
2 GB. Here every loop and macro body gets a tick at the start of each pass (added to the
parsed template before it compiles), every call made from a template ticks too, ``*``,
``+`` and ``**`` refuse results past a size, and the rendered text is counted as it
streams out. A tick past the deadline, or past the step or size limits, ends the render
with one line.
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TemplateError

TIME_LIMIT_S = 2.0  # real templates render in milliseconds, long chats included
MAX_STEPS = 5_000_000  # loop passes, macro calls and function calls, all together
MAX_OUTPUT_CHARS = 32 * 1024 * 1024  # a 1 MB paste renders; a runaway does not
MAX_VALUE_LEN = MAX_OUTPUT_CHARS  # one string or list built by * or +
MAX_POWER_DIGITS = 10_000  # ** results beyond this many digits are absurd for a prompt

_TICK = "_mlxdesk_template_tick"
_state = threading.local()


class TemplateLimitError(TemplateError):
    """The chat template ran too long or built something too big."""


class _Budget:
    def __init__(self, time_limit: float):
        self.deadline = time.monotonic() + time_limit
        self.time_limit = time_limit
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(
                f"The chat template took more than {MAX_STEPS:,} steps (a runaway loop); fix the template or pick another model."
            )
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"The chat template ran for more than {self.time_limit:g} s (a runaway loop); fix the template or pick another model."
            )


def _tick() -> str:
    budget = getattr(_state, "budget", None)
    if budget is not None:
        budget.tick()
    return ""


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"The chat template tried to build {what}; fix the template or pick another model.")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


class GuardedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with ticks on calls and size checks on * + **."""

    intercepted_binops = frozenset(["*", "+", "**"])

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                n = _size(seq)
                if n is not None and isinstance(times, int) and n * max(times, 0) > MAX_VALUE_LEN:
                    raise _too_big(f"a value of {n * times:,} items with '*'")
            return operator.mul(left, right)
        if op == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_VALUE_LEN:
                raise _too_big(f"a value of {a + b:,} items with '+'")
            return operator.add(left, right)
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            import math

            if right * math.log10(abs(left)) > MAX_POWER_DIGITS:
                raise _too_big("a number with more than 10,000 digits with '**'")
        return super().call_binop(context, op, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _tick()
        return super().call(context, obj, *args, **kwargs)


def _ticked(body: list[nodes.Node]) -> list[nodes.Node]:
    return [nodes.Output([nodes.Call(nodes.Name(_TICK, "load"), [], [], None, None)]), *body]


def compile_guarded(env: jinja2.Environment, source: str) -> jinja2.Template:
    """``env.from_string(source)`` with a tick at the start of every loop pass and macro body."""
    tree = env.parse(source)
    for node in tree.find_all((nodes.For, nodes.Macro, nodes.CallBlock)):
        node.body = _ticked(node.body)
    env.globals[_TICK] = _tick
    return env.from_string(tree)


def render_limited(template: jinja2.Template, time_limit: float = TIME_LIMIT_S, **variables: Any) -> str:
    """Render within the time, step and output limits above."""
    outer = getattr(_state, "budget", None)
    _state.budget = _Budget(time_limit)
    try:
        out, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise _too_big(f"a prompt of more than {MAX_OUTPUT_CHARS:,} characters")
            _tick()
            out.append(piece)
        return "".join(out)
    finally:
        _state.budget = outer
