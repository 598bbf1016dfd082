"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.models.kernel_switches import reread

ROOT = Path(__file__).resolve().parents[1]

# No test reaches the Hugging Face Hub: huggingface_hub is offline for the whole suite (set
# before anything imports it), and its endpoint is a local port where nothing listens, so
# a request that slips past offline mode fails at once on this machine. Tests of downloads
# run against tests/fake_hub.py, which lets the library online towards itself only.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


class _RereadingMonkeyPatch(pytest.MonkeyPatch):
    """pytest's MonkeyPatch, except that setting, removing or restoring an environment
    variable makes the kernels read their switches again (they keep their first reads:
    engine.models.kernel_switches)."""

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        reread()

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        reread()

    def undo(self) -> None:
        super().undo()
        reread()


@pytest.fixture
def monkeypatch():
    """Every test's ``monkeypatch``, the kernels' switches following its variables."""
    patch = _RereadingMonkeyPatch()
    yield patch
    patch.undo()


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
