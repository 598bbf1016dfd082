"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """The real test data beside the checkout (``../shared/data``), if present."""
    env = os.environ.get("MLX_DESK_SHARED_DATA")
    path = Path(env) if env else ROOT.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        pytest.skip("../shared/data is not present (it comes with the project's CI checkout)")
    return path
