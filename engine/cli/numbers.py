"""Numbers on the command line, read once and refused with one line when meaningless.

argparse's own ``type=int`` and ``type=float`` take ``0`` repeats, ``-64x-64`` pixels,
``1e400`` bytes (infinity) or ``nan`` and hand them on, where they end as a traceback, a
silent default or a segmentation fault far away. Every numeric flag goes through one of
these instead: ``whole`` (an integer in a range), ``real`` (a finite float in a range),
``frame_size`` (``WxH``). Each refusal names the flag, the range and what was given.

``Parser`` makes argparse's own refusals one line too (``error: ...`` and a pointer to
``--help``), as the engine CLI contract asks of every failure.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2, as argparse's)."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        named = re.match(r"argument (\S+): (.*)", line)
        if named and any(flag in named[2] for flag in named[1].split("/")):
            line = named[2]  # our parsers name the flag already: "argument --x: --x must ..." says it twice
        if line.endswith("expected one argument"):  # argparse took a value like -64x-64 for a flag
            line += "; a value that starts with '-' is written --flag=VALUE"
        self.exit(2, f"error: {line} (see {self.prog} --help)\n")


def _whole_text(text: str) -> int | None:
    """``2048``, ``2,048`` or ``2_048``; also ``1e3`` when it is a whole number."""
    cleaned = text.strip().replace(",", "").replace("_", "")
    try:
        return int(cleaned)
    except ValueError:
        pass
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else None


def whole(flag: str, minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum`` inclusive."""

    def parse(text: str) -> int:
        value = _whole_text(text)
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a whole number from {minimum:,} to {maximum:,} (got {text!r})"
            )
        return value

    parse.__name__ = "whole number"  # what argparse would name in its own messages
    return parse


def real(flag: str, minimum: float, maximum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [minimum, maximum] ((minimum, maximum] with ``above``)."""
    opening = "(" if above else "["

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        low_ok = value > minimum if above else value >= minimum
        if not math.isfinite(value) or not low_ok or value > maximum:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a finite number in {opening}{minimum:g}, {maximum:g}] (got {text!r})"
            )
        return value

    parse.__name__ = "number"
    return parse


def frame_size(flag: str, largest: int) -> Callable[[str], tuple[int, int]]:
    """An argparse type: ``WxH`` with both sides from 1 to ``largest`` pixels."""

    def parse(text: str) -> tuple[int, int]:
        width, sep, height = text.lower().partition("x")
        w, h = _whole_text(width), _whole_text(height)
        if not sep or w is None or h is None or not (1 <= w <= largest and 1 <= h <= largest):
            raise argparse.ArgumentTypeError(
                f"{flag} takes WIDTHxHEIGHT in pixels, each from 1 to {largest:,}, like 1280x720 (got {text!r})"
            )
        return w, h

    parse.__name__ = "frame size"
    return parse


def memory_bytes(text: str) -> int:
    """``--memory-budget``: bytes, or with a unit (``12GB``); finite, positive, under an exabyte."""
    from engine.errors import EngineError
    from engine.runtime.memory import parse_budget

    largest = 10**18
    try:
        value = parse_budget(text)
    except EngineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except (OverflowError, ValueError):  # infinity or NaN got past the parser's own check
        value = -1
    if not 0 < value <= largest:
        raise argparse.ArgumentTypeError(
            f"--memory-budget must be a size from 1 byte to 1 EB, like 12GB or 800MB (got {text!r})"
        )
    return value
