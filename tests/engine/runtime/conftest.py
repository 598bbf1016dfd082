from __future__ import annotations

from pathlib import Path

import pytest

from .tiny_folder import make_tiny_model_folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama")
