"""Tiny MoE checkpoints for the expert-streaming tests, from the golden folders.

Each golden folder (tests/golden) holds a family's tiny random checkpoint in one of its
published layouts: transformers' per-expert or fused tensors, OpenAI's MXFP4 blocks, or
mlx-lm's stacked (and quantized) ones. ``model_folder`` copies one beside a tokenizer so
the host and the command line can load it; ``resident`` and ``streamed`` load it whole or
with a share of experts read from the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from engine.runtime.loading import load_model
from tests.engine.models.model_goldens import greedy
from tests.tiny_models import CHATML_TEMPLATE, make_tokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

# (golden folder, layout it stores the experts in)
FAMILIES = {
    "qwen3_moe": "models/qwen3_moe",  # per-expert tensors
    "qwen3_5_moe": "models/qwen3_5_moe",  # per-expert tensors, hybrid attention
    "gpt_oss": "models/gpt_oss",  # transformers' [E, in, 2*inner], gate/up interleaved
    "gpt_oss_mxfp4": "mlx_layouts/gpt_oss_hf_mxfp4",  # OpenAI's MXFP4 blocks
    "gpt_oss_mlx_mxfp4": "mlx_layouts/gpt_oss_mlx_mxfp4",  # mlx-lm's stacked MXFP4
    "deepseek_v3": "models/deepseek_v3",
    "kimi_k2": "models/kimi_k2",
    "glm4_moe": "models/glm4_moe",
    "glm_moe_dsa": "models/glm_moe_dsa",
    "gemma4_moe": "models/gemma4_text_moe",  # fused gate_up_proj
    "lfm2_moe": "models/lfm2_moe",  # per-expert w1/w3/w2
    "qwen3_moe_affine4": "quant/qwen3_moe_affine_b4_g32",  # mlx-lm stacked, quantized
    "qwen3_moe_mixed": "quant/qwen3_moe_mixed_4_6",
    "qwen3_moe_mxfp8": "quant/qwen3_moe_mxfp8",
    "qwen3_moe_nvfp4": "quant/qwen3_moe_nvfp4_global_scale",  # per-expert global scales
    "qwen3_moe_mxfp4": "quant/qwen3_moe_mxfp4",
    "qwen3_next": "models/qwen3_next",
    "glm4_moe_lite": "models/glm4_moe_lite",
    "glm4_moe_lite_nvfp4": "mlx_layouts/glm4_moe_lite_nvfp4",
    "moonlight": "models/moonlight",
    "kimi_k2_mxfp4": "mlx_layouts/kimi_k2_mxfp4",
    "gemma4_moe_multimodal": "models/gemma4_moe",  # model.language_model.layers.N...
    "gpt_oss_mlx_q4": "mlx_layouts/gpt_oss_mlx_q4",
}
# Families whose goldens are in transformers' layout only: converted to mlx-lm's (4-bit).
CONVERTED = ["qwen3_5_moe", "lfm2_moe", "gemma4_moe", "deepseek_v3", "glm4_moe"]

PROMPT = [1, 5, 9, 23, 7, 40, 3, 11, 60, 2, 33, 17]


def golden(name: str) -> Path:
    return GOLDEN / FAMILIES[name]


def model_folder(tmp: Path, name: str) -> Path:
    """The golden checkpoint with a tokenizer, in a folder of its own (tests may break it)."""
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in golden(name).iterdir():
        if f.name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, folder / f.name)
    make_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}
        )
    )
    return folder


def load(folder: Path | str, fraction: float | None = None):
    """The model in float32, keeping ``fraction`` of its experts (None: all)."""
    return load_model(folder, resident_experts=fraction, dtype="float32").model


def run_greedy(model, n: int = 10, prompt=PROMPT):
    ids, logprobs = greedy(model, prompt, n)
    mx.clear_cache()
    return ids, logprobs


def store_of(model):
    return getattr(model, "_expert_store", None)
