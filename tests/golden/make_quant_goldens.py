"""Make the MLX-quantization references: mlx-lm's own converter and its own generation.

Needs mlx-lm (and transformers, for the tokenizer it saves); the tests do not. Each case
takes one of the tiny transformers checkpoints under tests/golden/models/, rewrites its
config.json into the spelling published repos carry (``rope_theta`` + ``rope_scaling``,
``num_experts``), which is what mlx-lm reads, and runs

    python -m mlx_lm convert --hf-path HF --mlx-path OUT -q --q-bits B --q-group-size G
        [--q-mode mxfp4|mxfp8|nvfp4] [--quant-predicate mixed_3_6]

into tests/golden/quant/<case>/. mlx-lm then loads that folder, casts it to float32 (the
tests compare in float32 too, so rounding of bf16 activations does not blur the check),
and records its greedy continuation of a fixed prompt with each chosen token's log-prob.

    python tests/golden/make_quant_goldens.py [case ...]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import get_total_parameters

HERE = Path(__file__).resolve().parent
BASES = HERE / "models"
OUT = HERE / "quant"
PROMPT_LEN = 20
NEW_TOKENS = 12

GLOBAL_SCALE = "global_scale"  # not a convert flag: quantize through mlx-lm's API instead

# case -> (base checkpoint, extra `mlx_lm convert` arguments after -q)
CASES: dict[str, tuple[str, list[str]]] = {
    # affine: every bit width at the default group size, the other group sizes at a few
    **{f"qwen3_affine_b{b}_g64": ("qwen3", ["--q-bits", str(b), "--q-group-size", "64"]) for b in (2, 3, 4, 5, 6, 8)},
    "qwen3_affine_b3_g32": ("qwen3", ["--q-bits", "3", "--q-group-size", "32"]),
    "qwen3_affine_b4_g32": ("qwen3", ["--q-bits", "4", "--q-group-size", "32"]),
    # hidden 64: at g128 only the 128-wide inputs (o_proj, down_proj) are quantized
    "qwen3_affine_b4_g128": ("qwen3", ["--q-bits", "4", "--q-group-size", "128"]),
    "qwen3_affine_b6_g128": ("qwen3", ["--q-bits", "6", "--q-group-size", "128"]),
    # the floating-point modes, at the one (bits, group size) pair each allows
    "qwen3_mxfp4": ("qwen3", ["--q-mode", "mxfp4"]),
    "qwen3_mxfp8": ("qwen3", ["--q-mode", "mxfp8"]),
    "qwen3_nvfp4": ("qwen3", ["--q-mode", "nvfp4"]),
    # mixed recipes: per-layer bits in the config's quantization block; mixed_2_6 is left
    # without a group size, so its per-layer entries say "group_size": null
    "qwen3_mixed_3_6": ("qwen3", ["--quant-predicate", "mixed_3_6", "--q-group-size", "64"]),
    "qwen3_mixed_2_6": ("qwen3", ["--quant-predicate", "mixed_2_6"]),
    # stacked experts (SwitchLinear): gate/up are 64 wide, down 32 wide
    "qwen3_moe_affine_b4_g32": ("qwen3_moe", ["--q-bits", "4", "--q-group-size", "32"]),
    "qwen3_moe_affine_b3_g64": ("qwen3_moe", ["--q-bits", "3", "--q-group-size", "64"]),
    "qwen3_moe_mxfp4": ("qwen3_moe", ["--q-mode", "mxfp4"]),
    "qwen3_moe_mxfp8": ("qwen3_moe", ["--q-mode", "mxfp8"]),
    "qwen3_moe_nvfp4": ("qwen3_moe", ["--q-mode", "nvfp4"]),
    "qwen3_moe_mixed_4_6": ("qwen3_moe", ["--quant-predicate", "mixed_4_6", "--q-group-size", "32"]),
    # nvfp4 with one float32 scale per expert: mlx-lm's Python API only (quantize_model's
    # global_scale); MLX multiplies with it on the GPU only, so no greedy reference here
    "qwen3_moe_nvfp4_global_scale": ("qwen3_moe", ["--q-mode", "nvfp4", GLOBAL_SCALE]),
}


def published_config(base: str) -> dict:
    """The base config in the spelling of published repos (what mlx-lm's families read)."""
    config = json.loads((BASES / base / "config.json").read_text())
    params = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    config["rope_scaling"] = {"type": rope_type, "rope_type": rope_type, **params} if rope_type != "default" else None
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    config.pop("dtype", None)
    config.pop("layer_types", None)
    config["torch_dtype"] = "bfloat16"  # convert keeps unquantized tensors in bf16, as stored
    return config


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over the ids (t0 t1 ...): mlx-lm's convert saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0")
    fast.save_pretrained(folder)


def footprint(folder: Path) -> tuple[int, int]:
    """Bytes of mlx-lm's loaded model (as stored) and its parameter count (quantized
    weights counted unpacked). Their ratio is mlx-lm's bits per weight, less the RoPE
    frequency buffers ``compute_bits_per_weight`` also counts, which are not weights."""
    model, _ = mlx_lm.load(str(folder))
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return nbytes, get_total_parameters(model)


def reference(folder: Path, prompt: list[int]) -> tuple[list[int], list[float], float]:
    model, _ = mlx_lm.load(str(folder))
    model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    ids, logprobs, margins = [], [], []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(NEW_TOKENS):
        lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
        top2 = mx.sort(lp)[-2:]
        token = int(mx.argmax(lp))
        ids.append(token)
        logprobs.append(float(lp[token]))
        margins.append(float(top2[1] - top2[0]))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return ids, logprobs, min(margins)


def make(case: str) -> None:
    base, args = CASES[case]
    expected_base = json.loads((BASES / base / "expected.json").read_text())
    folder = OUT / case
    if folder.exists():
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        config = published_config(base)
        (hf / "config.json").write_text(json.dumps(config, indent=2))
        shutil.copy(BASES / base / "model.safetensors", hf / "model.safetensors")
        write_tokenizer(hf, config["vocab_size"])
        if GLOBAL_SCALE in args:
            convert_with_global_scale(hf, folder)
        else:
            cmd = [
                sys.executable,
                "-m",
                "mlx_lm",
                "convert",
                "--hf-path",
                str(hf),
                "--mlx-path",
                str(folder),
                "-q",
                *args,
            ]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    nbytes, parameters = footprint(folder)
    (folder / "README.md").unlink(missing_ok=True)  # mlx-lm's model card
    expected = {
        "mlx_lm_version": mlx_lm.__version__,
        "mlx_version": mx.__version__,
        "base": base,
        "convert_args": ["-q", *args],
        "quantization": json.loads((folder / "config.json").read_text()).get("quantization"),
        "model_bytes": nbytes,
        "parameters": parameters,
        "bits_per_weight": 8 * nbytes / parameters,
    }
    if GLOBAL_SCALE not in args:
        expected.update(generation_reference(folder, expected_base["prompt_ids"], config["vocab_size"]))
    (folder / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{case}: {size // 1024} KB, greedy {expected.get('greedy_ids')}")


def convert_with_global_scale(hf: Path, folder: Path) -> None:
    """What ``convert`` does (bf16 as the config says, quantize, save), with
    ``quantize_model(global_scale=True)``, which the command line does not expose."""
    model, tokenizer, config = mlx_lm.utils.load(str(hf), return_config=True, lazy=True)
    model.set_dtype(mx.bfloat16)
    model, config = mlx_lm.utils.quantize_model(model, config, None, None, mode="nvfp4", global_scale=True)
    mlx_lm.utils.save(folder, str(hf), model, tokenizer, config)


def generation_reference(folder: Path, prompt: list[int], vocab: int) -> dict:
    """mlx-lm's greedy ids and log-probs. The base prompt first; a quantized model can put
    two tokens in a near-tie on it, and a 1e-4 difference could flip such a pick, so then
    another prompt is drawn."""
    for attempt in range(50):
        ids, logprobs, margin = reference(folder, prompt)
        if margin > 5e-3 and len(set(ids)) >= 3:
            break
        prompt = [int(t) for t in mx.random.randint(3, vocab, (PROMPT_LEN,), key=mx.random.key(attempt)).tolist()]
    else:
        raise SystemExit(f"{folder.name}: no prompt gave clear greedy margins")
    return {"prompt_ids": prompt, "greedy_ids": ids, "logprobs": logprobs, "min_top2_margin": margin}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        make(name)
