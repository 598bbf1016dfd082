"""Whatever slips past the checks still reaches the user as words, never a class name."""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.runtime.readable import readable
from tests.faults.test_engine_faults import CLASS_NAME

CASES = [
    (EngineError("the model folder has no config.json"), "the model folder has no config.json"),
    (MemoryError(), "out of memory"),
    (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not valid UTF-8"),
    (FileNotFoundError(2, "No such file or directory", "/x/y"), "No such file or directory: /x/y"),
    (ZeroDivisionError("division by zero"), "a model setting is out of range (division by zero)"),
    (OverflowError("Python int too large to convert to C long"), "out of range"),
    (KeyError("model.layers.0.weight"), "internal error ('model.layers.0.weight')"),
    (TypeError("unsupported operand"), "internal error (unsupported operand)"),
    (ValueError(""), "internal error (no details)"),
]


@pytest.mark.parametrize("exc,needle", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_every_exception_is_one_readable_line(exc, needle):
    line = readable(exc)
    assert needle in line and "\n" not in line
    assert not CLASS_NAME.search(line), line
