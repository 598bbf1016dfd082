"""Fixtures of the artifacts tests: tiny checkpoints in tmp_path."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_checkpoints import Checkpoint, write_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    """Factory: ``checkpoint(name, **write_checkpoint options)`` -> Checkpoint."""

    def make(name: str = "tiny", **options: Any) -> Checkpoint:
        return write_checkpoint(tmp_path / name, **options)

    return make
