"""Dataclass configs built from config.json dictionaries, which carry many settings a
given piece does not use."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_known_keys(cls: type[T], config: Mapping[str, Any] | None) -> T:
    """``cls(**config)`` with the keys ``cls`` has no field for left out."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in (config or {}).items() if k in names})
