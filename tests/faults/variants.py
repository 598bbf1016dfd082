"""Damaged copies of a tiny model folder, by name: each function changes a copy in place.
ADAPTER_VARIANTS do the same to a copy of a tiny mlx-lm adapter, or write a PEFT one."""

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


def _integer_weights(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    save_file({k: (v * 100).astype(np.int32) for k, v in weights.items()}, folder / "model.safetensors")


def _generation(text: str):
    def change(folder: Path) -> None:
        (folder / "generation_config.json").write_text(text)

    return change


def _sparse(name: str, size: int = 40 * 2**30):
    """A file of ``size`` zero bytes that takes no disk (a hole): what a read without a bound
    would try to hold in memory whole."""

    def change(folder: Path) -> None:
        with open(folder / name, "wb") as f:
            f.truncate(size)

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
    "int32_weights": _integer_weights,
    "eps_negative": _config(rms_norm_eps=-1.0),
    "eps_text": _config(rms_norm_eps="tiny"),
    "rope_garbage": _config(rope_scaling="garbage"),
    "rope_list": _config(rope_scaling=[1, 2, 3]),
    "rope_factor_negative": _config(rope_scaling={"rope_type": "linear", "factor": -2}),
    "yarn_without_length": _config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "theta_0": _config(rope_theta=0),
    "theta_negative": _config(rope_theta=-5),
    "theta_text": _config(rope_theta="big"),
    "positions_0": _config(max_position_embeddings=0),
    "positions_negative": _config(max_position_embeddings=-7),
    "tie_text": _config(tie_word_embeddings="yes"),
    "eos_text": _config(eos_token_id="end"),
    "generation_nan": _generation('{"temperature": NaN}'),
    "generation_top_p": _generation('{"top_p": 5}'),
    "generation_top_k": _generation('{"top_k": -3}'),
    "generation_text": _generation('{"temperature": "hot"}'),
    "generation_max_new": _generation('{"max_new_tokens": -1}'),
    "generation_penalty_inf": _generation('{"repetition_penalty": Infinity}'),
    "generation_list": _generation("[1, 2]"),
    "config_40gb": _sparse("config.json"),
    "generation_40gb": _sparse("generation_config.json"),
    "tokenizer_40gb": _sparse("tokenizer.json"),
    "tokenizer_config_40gb": _sparse("tokenizer_config.json"),
    "template_40gb": _sparse("chat_template.jinja"),
    "index_40gb": _sparse("model.safetensors.index.json"),
    "template_number": _template(5),
    "quantization_text": _config(quantization={"bits": "four", "group_size": 64}),
}


def _adapter_config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "adapter_config.json").read_text())
        config["lora_parameters"].update(changes)
        (folder / "adapter_config.json").write_text(json.dumps(config, allow_nan=True))

    return change


def _peft(**changes):
    """Replace the mlx-lm files with a PEFT adapter on q_proj (rank 4) of the tiny model."""

    def change(folder: Path) -> None:
        for old in folder.iterdir():
            old.unlink()
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **changes}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        tensors = {}
        for i in range(2):
            path = f"base_model.model.model.layers.{i}.self_attn.q_proj"
            tensors[f"{path}.lora_A.weight"] = np.full((4, 64), 0.01, np.float32)
            tensors[f"{path}.lora_B.weight"] = np.full((64, 4), 0.01, np.float32)
        save_file(tensors, folder / "adapter_model.safetensors")

    return change


def _truncated_adapter(folder: Path) -> None:
    data = (folder / "adapters.safetensors").read_bytes()
    (folder / "adapters.safetensors").write_bytes(data[: len(data) // 2])


ADAPTER_VARIANTS = {
    "peft_good": _peft(),
    "peft_r0": _peft(r=0),
    "peft_r_negative": _peft(r=-4),
    "peft_r_mismatch": _peft(r=8),
    "peft_alpha_text": _peft(lora_alpha="x"),
    "peft_alpha_huge": _peft(lora_alpha=1e300),
    "mlx_scale_text": _adapter_config(scale="big"),
    "mlx_scale_nan": _adapter_config(scale=float("nan")),
    "mlx_scale_1e30": _adapter_config(scale=1e30),
    "mlx_rank_mismatch": _adapter_config(rank=16),
    "adapter_config_40gb": _sparse("adapter_config.json"),
    "adapter_truncated": _truncated_adapter,
}
