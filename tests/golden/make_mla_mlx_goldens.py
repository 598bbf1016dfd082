"""mlx-lm's own layout of the latent-attention / routed-MoE families, and mlx-lm's own
greedy output on it: the reference for loading what mlx-community publishes.

For each published-spelling golden made by make_mla_goldens.py (mlx-lm reads only the
repos' spelling), mlx-lm's converter writes a 4-bit (group 32) copy, for two of them also one in a
float mode (mxfp4, nvfp4); mlx-lm then loads that
folder and decodes greedily in float32, recording ids and log-probs. The converter needs a
tokenizer to load a folder; the GPT-2 one from the shared data stands in (the tiny models
ignore it) and is left out of the stored folder.

    python tests/golden/make_mla_mlx_goldens.py [name ...]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
from mlx_lm.convert import convert
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "models"
OUT = HERE / "mlx_layouts"
TOKENIZER = HERE.parents[1] / ".." / "shared" / "data" / "tokenizers" / "gpt2"
BITS, GROUP = 4, 32

_load_tokenizer = mlx_lm.utils.load_tokenizer
mlx_lm.utils.load_tokenizer = lambda _path, *args, **kwargs: _load_tokenizer(TOKENIZER.resolve(), *args, **kwargs)

# output folder -> (make_mla_goldens.py folder, family it stands for, quantization mode)
NAMES = {
    "kimi_k2": ("kimi_k2", "deepseek_v3 (as kimi_k2)", "affine"),
    "moonlight": ("moonlight", "deepseek_v3", "affine"),
    "glm4_moe_published": ("glm4_moe_published", "glm4_moe", "affine"),
    "glm4_moe_lite_published": ("glm4_moe_lite_published", "glm4_moe_lite", "affine"),
    "glm_moe_dsa_every_layer": ("glm_moe_dsa_every_layer", "glm_moe_dsa", "affine"),
    # The float modes (their bits and group size are the mode's own).
    "kimi_k2_mxfp4": ("kimi_k2", "deepseek_v3 (as kimi_k2)", "mxfp4"),
    "glm4_moe_lite_nvfp4": ("glm4_moe_lite_published", "glm4_moe_lite", "nvfp4"),
}


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    ids, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        logprobs.append(float(lp[0, token].item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return ids, logprobs


def make(name: str) -> None:
    golden, family, mode = NAMES[name]
    source = SOURCE / golden
    expected = json.loads((source / "expected.json").read_text())
    folder = OUT / name
    if folder.exists():
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        shutil.copytree(source, hf)
        # mlx-lm drops MTP layers only at DeepSeek V3's own index (61): leave the stand-ins out.
        n_layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        weights = mx.load(str(hf / "model.safetensors"))
        keep = {k: v for k, v in weights.items() if not k.startswith(f"model.layers.{n_layers}.")}
        mx.save_safetensors(str(hf / "model.safetensors"), keep, {"format": "pt"})
        config = json.loads((hf / "config.json").read_text())
        config.setdefault("rope_scaling", None)  # mlx-lm's GLM args require the key (the repos carry null)
        for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
            config.setdefault(key, value)  # DeepSeek-style keys the repos carry and mlx-lm requires
        (hf / "config.json").write_text(json.dumps(config))
        bits, group = (BITS, GROUP) if mode == "affine" else (None, None)
        convert(str(hf), str(folder), quantize=True, q_bits=bits, q_group_size=group, q_mode=mode, dtype="float32")
    for f in folder.iterdir():  # keep the weights and config only
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    model, _ = load(str(folder))
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    record = {
        "mlx_lm_version": mlx_lm.__version__,
        "family": family,
        "quantization": json.loads((folder / "config.json").read_text())["quantization"],
        "prompt_ids": expected["prompt_ids"],
        "greedy_ids": ids,
        "logprobs": logprobs,
        "transformers_greedy_ids": expected["greedy_ids"],
    }
    (folder / "expected.json").write_text(json.dumps(record, indent=2) + "\n")
    stored = mx.load(str(folder / "model.safetensors"))
    quantized = sorted({k.rsplit(".", 2)[-2] for k in stored if k.endswith(".scales")})
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: {size // 1024} KB, quantized {quantized}, greedy {ids}")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(NAMES):
        make(n)
