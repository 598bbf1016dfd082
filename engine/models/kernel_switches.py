"""The CUDA kernels' build and routing switches (``MLX_DESK_*`` environment variables),
read once.

A step that runs uncompiled (latent attention, the MoE and hybrid layers that decline the
compiled step) asks, for every quantized product, which kernel takes it and how that kernel
is built, and each answer reads several switches. A read from ``os.environ`` costs about a
microsecond, and one product's set of reads about 8: some 2 ms of host time a step for a
model of ~250 products. So a switch's value is kept from its first read for the life of the
process, as a variable set before start is meant.

``reread`` forgets the kept values; the test suite calls it whenever a test sets or removes
a variable (its ``monkeypatch`` fixture).
"""

from __future__ import annotations

import os

_kept: dict[tuple[str, str], str] = {}


def switch(name: str, default: str = "") -> str:
    """The value of the environment variable ``name`` (``default`` where unset), as first read."""
    key = (name, default)
    value = _kept.get(key)
    if value is None:
        value = _kept[key] = os.environ.get(name, default)
    return value


def reread() -> None:
    """Forget the kept values: the next ``switch`` of each reads the environment again."""
    _kept.clear()
