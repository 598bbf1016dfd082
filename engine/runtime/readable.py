"""One readable line for any exception, without Python's class names.

Deliberate failures (EngineError) already say what went wrong and what to do. Anything
else is a bug or a damaged input that slipped past a check; it still reaches the user as
words ("a setting is out of range"), never as ``ZeroDivisionError`` or ``RecursionError``.
"""

from __future__ import annotations

from engine.errors import EngineError


def _text(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def readable(exc: BaseException) -> str:
    """What went wrong, in one line a person can act on."""
    text = _text(exc)
    if isinstance(exc, EngineError):
        return text or "the engine refused the request"
    if isinstance(exc, MemoryError):
        return "out of memory: try a smaller model, a shorter prompt or a lower --max-tokens"
    if isinstance(exc, RecursionError):
        return "the input is nested too deeply to read (a damaged or hostile file)"
    if isinstance(exc, UnicodeError):
        where = ""
        if isinstance(exc, (UnicodeDecodeError, UnicodeEncodeError)):
            where = f" at character {exc.start}"
        return f"text that is not valid UTF-8{where}: give UTF-8 text"
    if isinstance(exc, OSError):
        what = exc.strerror or text or "the file could not be read or written"
        return f"{what}: {exc.filename}" if exc.filename else what
    if isinstance(exc, ArithmeticError):  # a zero or overflowing size that slipped past the checks
        detail = f" ({text})" if text else ""
        return f"a model setting is out of range{detail}: the model's files look damaged or inconsistent"
    detail = text or "no details"
    return f"internal error ({detail}): please report it with what you did"
