from __future__ import annotations

from pathlib import Path

import pytest

from .tiny_folder import make_tiny_adapter, make_tiny_model_folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different mlx-lm LoRA adapters that fit tiny_model_dir, named by folder."""
    root = tmp_path_factory.mktemp("tiny_adapters")
    return {name: make_tiny_adapter(root / name, seed=seed) for name, seed in (("alpha", 11), ("beta", 12))}


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other random weights, same tokenizer: a draft model for tiny_model_dir."""
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny_draft") / "tiny-draft", seed=1)
