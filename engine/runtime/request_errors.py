"""The host's refusals of a request: no model yet, or cancelled before it finished."""

from __future__ import annotations

from engine.errors import EngineError


class NoModelLoaded(EngineError):
    """A request that needs a model arrived before any was loaded."""


class Cancelled(EngineError):
    """The request was cancelled before it finished."""
