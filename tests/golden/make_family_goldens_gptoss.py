"""Reference outputs for gpt-oss, SmolLM3 and Ministral 3 (and mistral3's text model).

Needs torch, transformers 5.23 and mlx-lm (the tests need none of them). Like
make_model_goldens.py it builds tiny random transformers models, stores them (bf16 on
disk) under tests/golden/models/<name>/ with transformers' greedy ids and log-probs in
float32, each family in both config spellings: what transformers 5 writes and what the
published repos carry. Every setting with a default gets another value; sliding windows
are shorter than the prompt.

gpt-oss also gets tests/golden/mlx_layouts/:
- ``gpt_oss_hf_mxfp4``: OpenAI's release layout, experts as MXFP4 ``*_blocks``/``*_scales``
  (quantized here); its reference is transformers on the dequantized weights, which
  transformers' own MXFP4 loader must reproduce (checked);
- ``gpt_oss_mlx_*``: that folder through mlx-lm's ``convert`` (as is; dequantized; re-quantized
  with ``--q-mode mxfp4`` and affine 4-bit g32), each with mlx-lm's own greedy ids and
  log-probs in float32 as the reference.
mlx-lm hard-codes the SwiGLU alpha/limit and reads only the published spelling, so that
set uses the published defaults there; the transformers-only folders cover the rest.

    python tests/golden/make_family_goldens_gptoss.py [name ...]
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_common import greedy_record
from make_model_goldens import COMMON, OUT, build, find_seed, reference

LAYOUTS = Path(__file__).resolve().parent / "mlx_layouts"

GPT_OSS = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "tie_word_embeddings": True,
    "swiglu_alpha": 1.3,
    "swiglu_limit": 0.6,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "truncate": True,
        "original_max_position_embeddings": 16,
        "rope_theta": 5e4,
    },
}

MINISTRAL_ROPE = {
    "rope_type": "yarn",
    "type": "yarn",
    "rope_theta": 1e5,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "max_position_embeddings": 256,
    "beta_fast": 8.0,
    "beta_slow": 2.0,
    "mscale": 1.2,
    "mscale_all_dim": 0.9,
    "llama_4_scaling_beta": 0.3,
}
MINISTRAL = {
    "model_type": "ministral3",
    "head_dim": 16,
    "sliding_window": 8,
    "tie_word_embeddings": True,
    "rope_parameters": MINISTRAL_ROPE,
}

SMOLLM3 = {
    "model_type": "smollm3",
    "num_hidden_layers": 4,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "mlp_bias": True,
    "use_sliding_window": True,
    "sliding_window": 8,
    "no_rope_layers": [1, 0, 0, 1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 3e4},
}


def _published_gpt_oss(config: dict) -> dict:
    """The spelling of OpenAI's repos: rope_theta + rope_scaling, experts_per_token beside
    num_experts_per_tok (transformers reads only the latter), initial_context_length."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    config["experts_per_token"] = config["num_experts_per_tok"]
    config["initial_context_length"] = params["original_max_position_embeddings"]
    config.pop("swiglu_alpha", None)  # not in the published configs: the default applies
    config.pop("layer_types", None)  # older configs: the default alternation applies
    return config


def _legacy_rope(config: dict) -> dict:
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        config["rope_scaling"] = params
    return config


def _interval_only(config: dict) -> dict:
    """SmolLM3 with its NoPE layers given as an interval only (layer kinds derived)."""
    config = _legacy_rope(config)
    config.pop("no_rope_layers")
    config.pop("layer_types")
    return config


# name -> (model settings, rewrite of the saved config.json into the other spelling or None)
VARIANTS = {
    "gpt_oss": (GPT_OSS, None),
    "gpt_oss_published": (
        {
            **GPT_OSS,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 0.8,
            "layer_types": None,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 16.0,
                "beta_slow": 1.5,
                "truncate": False,
                "original_max_position_embeddings": 12,
                "rope_theta": 2e5,
            },
        },
        _published_gpt_oss,
    ),
    "ministral3": (MINISTRAL, None),
    "smollm3": (SMOLLM3, None),
    "smollm3_interval": (
        {
            **SMOLLM3,
            "no_rope_layers": None,
            "no_rope_layer_interval": 3,
            "num_hidden_layers": 3,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3e4},
        },
        _interval_only,
    ),
}


def _search(name: str, make_model):
    found = find_seed(name, make_model)
    model, _, prompt, generated = found[:4]
    _check_cache_consistency(model, prompt, generated)
    return found


def _check_cache_consistency(model, prompt, generated) -> None:
    """transformers' cached greedy must equal recomputing the whole sequence each step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in generated:
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert ids[len(prompt) :] == generated, "transformers' cached and uncached greedy disagree"


def _write(folder: Path, config: dict, expected: dict, files: Path | None = None) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if files is not None:
        for f in files.iterdir():
            if f.suffix in (".safetensors", ".json") and f.name != "config.json":
                shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder.name}: {size // 1024} KB, greedy {expected['greedy_ids']}")


def _expected(seed, prompt, generated, logprobs, margins, spelling: str) -> dict:
    return greedy_record(seed, prompt, generated, logprobs, margins, config_spelling=spelling)


def make(name: str) -> None:
    overrides, rewrite = VARIANTS[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    model, seed, prompt, generated, logprobs, margins = _search(name, lambda s: build(name, overrides, s))
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        config = json.loads((Path(tmp) / "config.json").read_text())
        if rewrite is not None:
            config = rewrite(config)
        config["torch_dtype"] = "float32"
        spelling = "transformers 5" if rewrite is None else "published repos"
        _write(OUT / name, config, _expected(seed, prompt, generated, logprobs, margins, spelling), Path(tmp))


# ---- mistral3: Ministral 3 as the published repos wrap it ---------------------------------


def make_mistral3() -> None:
    """A mistral3 wrapper (tiny Pixtral tower + projector) whose text_config is ministral3;
    the text-only greedy is the reference (the tower's weights must be skipped)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {**COMMON, **MINISTRAL, "rope_parameters": {**MINISTRAL_ROPE, "llama_4_scaling_beta": 0.5}}
    text.pop("model_type")
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 28,
        "patch_size": 14,
    }

    def make_model(seed):
        torch.manual_seed(seed)
        cfg = Mistral3Config(
            text_config={"model_type": "ministral3", **text},
            vision_config={"model_type": "pixtral", **vision},
            image_token_index=3,
            spatial_merge_size=1,
            tie_word_embeddings=False,
        )
        m = Mistral3ForConditionalGeneration(cfg)
        with torch.no_grad():
            for _, p in m.named_parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.15)
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        m.config._attn_implementation = "eager"
        return m.eval()

    model, seed, prompt, generated, logprobs, margins = _search("mistral3", make_model)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        config = json.loads((Path(tmp) / "config.json").read_text())
        config["torch_dtype"] = "float32"
        _write(
            OUT / "mistral3_ministral",
            config,
            _expected(seed, prompt, generated, logprobs, margins, "published repos (mistral3 wrapper)"),
            Path(tmp),
        )


# ---- gpt-oss layouts: MXFP4 release and mlx-lm conversions ---------------------------------

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's MXFP4 packing of a transformers expert weight [E, in, out]: blocks
    [E, out, in/32, 16] (two e2m1 nibbles a byte, low nibble first) and scales
    [E, out, in/32] (e8m0: exponent + 127)."""
    w = weight.transpose(1, 2).float()  # [E, out, in]
    e, o, i = w.shape
    groups = w.reshape(e, o, i // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exp)
    codes = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1) + 8 * (scaled < 0).long()
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


def make_layouts() -> None:
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    settings = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 6,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 2.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 5e4,
        },
    }

    def make_model(seed):
        model = build("gpt_oss", settings, seed)
        with torch.no_grad():  # experts hold what their MXFP4 form decodes to
            for layer in model.model.layers:
                for proj in ("gate_up_proj", "down_proj"):
                    p = getattr(layer.mlp.experts, proj)
                    blocks, scales = to_mxfp4(p)
                    p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        return model

    model, seed, prompt, generated, logprobs, margins = _search("gpt_oss_mxfp4", make_model)
    hf = LAYOUTS / "gpt_oss_hf_mxfp4"
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        config = _published_gpt_oss(json.loads((Path(tmp) / "config.json").read_text()))
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    config["torch_dtype"] = "bfloat16"
    tensors = {}
    for key, value in model.to(torch.bfloat16).state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = to_mxfp4(value.float())
            tensors[key + "_blocks"] = blocks
            tensors[key + "_scales"] = scales
        else:
            tensors[key] = value.contiguous()
    expected = _expected(seed, prompt, generated, logprobs, margins, "published repos (MXFP4 experts)")
    _write(hf, config, expected)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(hf)
    _check_transformers_mxfp4(hf, prompt, generated, logprobs)

    # mlx-lm's conversions, each judged by mlx-lm's own greedy on the folder it wrote.
    convert_all(
        hf,
        prompt,
        len(generated),
        {
            "gpt_oss_mlx_mxfp4": (hf, []),
            "gpt_oss_mlx_bf16": (hf, ["--dequantize"]),
            "gpt_oss_mlx_q_mxfp4": ("gpt_oss_mlx_bf16", ["-q", "--q-mode", "mxfp4"]),
            "gpt_oss_mlx_q4": ("gpt_oss_mlx_bf16", ["-q", "--q-bits", "4", "--q-group-size", "32"]),
        },
    )


def convert_all(hf: Path, prompt: list[int], n: int, runs: dict[str, tuple[Path | str, list[str]]]) -> None:
    """``mlx_lm convert`` each (source, flags) into LAYOUTS/<name>, with mlx-lm's own greedy
    ids and log-probs on the result in expected.json."""
    for name, (source, flags) in runs.items():
        src = source if isinstance(source, Path) else LAYOUTS / source
        out = LAYOUTS / name
        if out.exists():
            shutil.rmtree(out)
        subprocess.run(
            [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out), *flags],
            check=True,
            capture_output=True,
        )
        ids, lps, margin = mlx_lm_greedy(out, prompt, n)
        assert margin > 1e-3, f"{name}: mlx-lm's greedy has a near-tie ({margin})"
        data = {
            "mlx_lm_version": _mlx_lm_version(),
            "convert_flags": flags,
            "source": src.name,
            "prompt_ids": prompt,
            "greedy_ids": ids,
            "logprobs": lps,
            "min_top2_margin": margin,
        }
        (out / "expected.json").write_text(json.dumps(data, indent=2) + "\n")
        (out / "README.md").unlink(missing_ok=True)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{name}: {size // 1024} KB, mlx-lm greedy {ids}")


# Ministral 3 and SmolLM3 in the spellings mlx-lm reads (rope_parameters for ministral3;
# rope_theta and the no_rope_layers list for smollm3, whose sliding window mlx-lm lacks).
MLX_FAMILIES = {
    "ministral3": (
        {**MINISTRAL, "sliding_window": None},
        None,
        {"q4": ["-q", "--q-bits", "4", "--q-group-size", "32"], "q8": ["-q", "--q-bits", "8", "--q-group-size", "64"]},
    ),
    "smollm3": (
        {**SMOLLM3, "use_sliding_window": False, "sliding_window": None},
        _legacy_rope,
        {
            "q4": ["-q", "--q-bits", "4", "--q-group-size", "64"],
            "nvfp4": ["-q", "--q-mode", "nvfp4"],
            "mxfp8": ["-q", "--q-mode", "mxfp8"],
        },
    ),
}
# Not Ministral 3 in the float modes: their embeddings dequantize to bf16, and mlx-lm then
# multiplies the position scale in float32 where transformers (and this engine) cast it to
# the queries' dtype, a 2e-3 log-prob difference that says nothing about loading.


def make_mlx_family(name: str) -> None:
    settings, rewrite, modes = MLX_FAMILIES[name]
    model, _, prompt, generated, _, _ = _search(name, lambda s: build(name, settings, s))
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        config_file = Path(tmp) / "config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps(rewrite(config) if rewrite else config))
        _write_tokenizer(Path(tmp))
        convert_all(
            Path(tmp),
            prompt,
            len(generated),
            {f"{name}_mlx_{mode}": (Path(tmp), flags) for mode, flags in modes.items()},
        )


def _mlx_lm_version() -> str:
    import mlx_lm

    return mlx_lm.__version__


def mlx_lm_greedy(folder: Path, prompt: list[int], n: int):
    """mlx-lm's own model on ``folder``, in float32, greedy through its own caches."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.update(
        tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters())
    )
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    ids, lps, margin = [], [], math.inf
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.sort(lp[0])[-2:].tolist()
        margin = min(margin, top[1] - top[0])
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        lps.append(float(lp[0, token].item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return ids, lps, margin


def _check_transformers_mxfp4(folder: Path, prompt, generated, logprobs) -> None:
    """transformers' own MXFP4 loader (dequantizing on CPU) must read the folder as meant."""
    from transformers import Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32, attn_implementation="eager"
    )
    ids, lps, _ = reference(model.eval(), prompt)
    worst = max(abs(a - b) for a, b in zip(lps, logprobs))
    assert ids == generated and worst < 1e-4, f"transformers reads the MXFP4 folder otherwise ({worst})"


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: mlx-lm's convert wants one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "bos_token": "t1"}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    names = sys.argv[1:] or [*VARIANTS, "mistral3", "layouts", *(f"mlx_{f}" for f in MLX_FAMILIES)]
    for n in names:
        if n == "mistral3":
            make_mistral3()
        elif n == "layouts":
            make_layouts()
        elif n.startswith("mlx_"):
            make_mlx_family(n.removeprefix("mlx_"))
        else:
            make(n)
