"""Fixtures for the adapter tests: the tiny Llama and PEFT adapters in tests/golden/adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from engine.models import get_family

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "adapters"


def load_tiny_llama():
    config = json.loads((GOLDEN / "base" / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = model.sanitize(dict(mx.load(str(GOLDEN / "base" / "model.safetensors"))))
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


@pytest.fixture
def tiny_llama():
    return load_tiny_llama()


@pytest.fixture(scope="session")
def golden_logits() -> dict[str, mx.array]:
    return dict(mx.load(str(GOLDEN / "logits.safetensors")))


@pytest.fixture(scope="session")
def prompt() -> mx.array:
    return mx.array([json.loads((GOLDEN / "prompt.json").read_text())["prompt"]])


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory) -> Path:
    """The golden adapters laid out as their tools write them. The mlx-lm copies are kept
    as weights.safetensors in the repository and take mlx-lm's file name here."""
    out = tmp_path_factory.mktemp("adapters") / "golden"
    shutil.copytree(GOLDEN, out)
    for weights in out.glob("mlxlm_*/weights.safetensors"):
        weights.rename(weights.with_name("adapters.safetensors"))
    return out
