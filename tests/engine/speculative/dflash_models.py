"""Tiny random DFlash drafters in the published layout (config.json + model.safetensors, the
names z-lab's checkpoints use), for tiny Qwen3 and Llama targets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.models.dflash import DFlashArgs, DFlashDraft


def drafter_config(
    target: Any, *, layers: int = 2, block: int = 4, layer_ids=(0, 1), mask: int | None = None, **extra
) -> dict:
    """A published-style config.json for a drafter of ``target`` (non-default values where a
    default could hide a mistake: theta, eps, head_dim)."""
    args = target.args
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "attention_bias": False,
        "max_position_embeddings": 512,
        "vocab_size": args.vocab_size,
        "num_target_layers": len(target.layers),
        "block_size": block,
        "dflash_config": {
            "mask_token_id": args.vocab_size - 1 if mask is None else mask,
            "target_layer_ids": list(layer_ids),
        },
        "torch_dtype": "float32",
        **extra,
    }


def random_weights(config: dict, seed: int = 3) -> dict[str, np.ndarray]:
    """Published weight names and shapes, random values (norms away from 1)."""
    rng = np.random.default_rng(seed)
    h, d = config["hidden_size"], config["head_dim"]
    nq, nkv, ff = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    n_ids = len(config["dflash_config"]["target_layer_ids"])

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    out = {"fc.weight": w(h, n_ids * h, scale=0.1), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": w(nq * d, h),
                p + "self_attn.k_proj.weight": w(nkv * d, h),
                p + "self_attn.v_proj.weight": w(nkv * d, h),
                p + "self_attn.o_proj.weight": w(h, nq * d),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": w(ff, h),
                p + "mlp.up_proj.weight": w(ff, h),
                p + "mlp.down_proj.weight": w(h, ff),
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
            }
        )
    return out


def write_drafter(folder: Path, config: dict, seed: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: mx.array(v) for k, v in random_weights(config, seed).items()}
    )
    return folder


def make_drafter(target: Any, seed: int = 3, **options: Any) -> DFlashDraft:
    """A tiny random drafter for ``target``, built in memory (float32)."""
    config = drafter_config(target, **options)
    model = DFlashDraft(DFlashArgs.from_config(config))
    model.load_weights([(k, mx.array(v)) for k, v in random_weights(config, seed).items()], strict=True)
    mx.eval(model.parameters())
    return model
