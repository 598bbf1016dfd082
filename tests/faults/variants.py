"""Damaged copies of a tiny model folder, by name: each function changes a copy in place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.faults.corpus import LOOPING_TEMPLATE, RAISING_TEMPLATE


def _config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return change


def _weights(fill: float):
    def change(folder: Path) -> None:
        weights = load_file(folder / "model.safetensors")
        name = "model.norm.weight" if np.isnan(fill) else "lm_head.weight"
        weights[name] = np.full_like(weights[name], fill)
        save_file(weights, folder / "model.safetensors")

    return change


def _raw_config(text: str):
    def change(folder: Path) -> None:
        (folder / "config.json").write_text(text)

    return change


def _template(source: str):
    def change(folder: Path) -> None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = source
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    return change


VARIANTS = {
    "looping_template": _template(LOOPING_TEMPLATE),
    "raising_template": _template(RAISING_TEMPLATE),
    "ctx64": _config(max_position_embeddings=64),
    "nan_weights": _weights(float("nan")),
    "inf_weights": _weights(float("inf")),
    "layers_1e6": _config(num_hidden_layers=1_000_000),
    "hidden_0": _config(hidden_size=0),
    "heads_0": _config(num_attention_heads=0),
    "kv_heads_0": _config(num_key_value_heads=0),
    "negative_width": _config(intermediate_size=-5),
    "text_width": _config(hidden_size="big"),
    "fractional_layers": _config(num_hidden_layers=2.5),
    "huge_vocab": _config(vocab_size=10**12),
    "wrong_width": _config(hidden_size=96),
    "deep_config": _raw_config("[" * 200_000 + "]" * 200_000),
}
