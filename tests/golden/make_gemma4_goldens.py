"""Make the Gemma 4 reference outputs (tests/golden/models/gemma4_*).

Needs torch + transformers 5.23 (and mlx-lm 0.32 for the MLX layout); the tests do not.
Each variant is a tiny random Gemma 4 whose every config switch is off its default,
saved in bfloat16 with transformers' greedy continuation of a prompt longer than the
sliding window (see make_model_goldens.py for the layout of a golden folder).

Two config spellings exist for Gemma 4 (its RoPE is always ``rope_parameters`` keyed by
layer type; transformers 5.23 cannot read a flat ``rope_scaling`` for it):

* transformers 5.23 writes the global layers' head size and KV heads as a
  ``per_layer_config`` table keyed by layer index;
* the published google/gemma-4-* repos carry ``global_head_dim`` and
  ``num_global_key_value_heads`` instead, inside the multimodal ``gemma4`` wrapper
  (``text_config``, weights under ``model.language_model.``).

The published-spelling folders are reloaded through transformers from the rewritten
config before the reference runs, so the golden is what transformers makes of that file.

The MLX layout: mlx-lm's own ``convert`` (4-bit, its Gemma 4 quantization predicate
keeps the router at 8 bits) of the MoE checkpoint, with mlx-lm's own greedy decoding
on that folder as the referee.

    python tests/golden/make_gemma4_goldens.py [name ...]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from golden_common import (
    folder_kb,
    greedy_record,
    save_checkpoint,
    search_seed,
    uncached_greedy,
    write_config,
    write_json,
)
from make_model_goldens import NEW_TOKENS, PROMPT_LEN, reference
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
)

OUT = Path(__file__).resolve().parent / "models"
MLX_OUT = Path(__file__).resolve().parent / "gemma4_mlx"  # quantized: not one of models/' float goldens

COMMON = dict(
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    vocab_size_per_layer_input=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    sliding_window=8,  # shorter than the prompt; the shared trim test needs >= 8
)

# Five layers, two of them reusing earlier layers' keys and values (layer 3 the sliding
# layer 2's, layer 4 the full layer 1's): the E2B/E4B layout at toy size.
DENSE = dict(
    COMMON,
    model_type="gemma4_text",
    num_hidden_layers=5,
    intermediate_size=48,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    use_double_wide_mlp=True,
    attention_bias=True,
    final_logit_softcapping=12.0,
    hidden_activation="silu",
    tie_word_embeddings=False,
    global_head_dim=32,
    rope_parameters={
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "rope_theta": 50000.0,
            "factor": 2.0,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
)

# The 26B-A4B layout at toy size: a routed expert block beside the dense MLP, keys
# doubling as values on the global layers, fewer global KV heads, no per-layer inputs.
MOE = dict(
    COMMON,
    model_type="gemma4_text",
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    attention_k_eq_v=True,
    global_head_dim=32,
    num_global_key_value_heads=1,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 200000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
)

# The dense layout with the switches mlx-lm 0.32 does not read left at their defaults
# (it has no attention bias and always uses tanh-GELU), for its converted layout.
E2B = dict(
    DENSE,
    attention_bias=False,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    final_logit_softcapping=30.0,
)

# name -> (text settings, published spelling?)
VARIANTS: dict[str, tuple[dict, bool]] = {
    "gemma4_text_ple": (DENSE, False),
    "gemma4_ple_published": (DENSE, True),
    "gemma4_e2b_published": (E2B, True),
    "gemma4_moe": (MOE, True),
    "gemma4_text_moe": (MOE, False),
}
# Converted with mlx-lm (4-bit) into tests/golden/gemma4_mlx/<name>_mlx_q4.
MLX_SOURCES = ("gemma4_moe", "gemma4_e2b_published")

# A tiny vision tower in the multimodal checkpoints, whose weights the language model must skip.
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    position_embedding_size=64,
)


def build(settings: dict, multimodal: bool, seed: int):
    torch.manual_seed(seed)
    text = {k: v for k, v in settings.items() if k != "model_type"}
    if multimodal:
        config = Gemma4Config(
            text_config=text,
            vision_config=VISION,
            audio_config=None,
            tie_word_embeddings=text.get("tie_word_embeddings", True),
        )
        model = Gemma4ForConditionalGeneration(config)
    else:
        config = AutoConfig.for_model("gemma4_text", **text)
        model = AutoModelForCausalLM.from_config(config)
    randomise(model)
    return model


def randomise(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms, router scales, biases: make a (1 + w) vs w mix-up show
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
            if name.endswith("embed_tokens.weight"):
                p.mul_(0.2)  # sqrt(hidden)-scaled and tied: keep the own-token echo down
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # stored in the checkpoint; 1 by default
                b.copy_(torch.empty_like(b).uniform_(0.6, 1.4).to(torch.bfloat16).to(torch.float32))
    model.eval()


def published(config: dict) -> dict:
    """transformers 5.23's spelling -> the published repos' spelling."""
    text = config.get("text_config", config)
    table = text.pop("per_layer_config", {}) or {}
    for overrides in table.values():
        text["global_head_dim"] = overrides["head_dim"]
        if "num_key_value_heads" in overrides:
            text["num_global_key_value_heads"] = overrides["num_key_value_heads"]
    return config


def make(name: str) -> None:
    settings, spelled_published = VARIANTS[name]
    model, seed, prompt, generated, logprobs, margins = search_seed(
        name,
        lambda s: build(settings, spelled_published, s),
        reference,
        PROMPT_LEN,
        seeds=200,
        vocab=settings["vocab_size"],
    )

    folder = OUT / name
    config = save_checkpoint(model, folder)
    if spelled_published:
        config = published(config)
    write_config(folder, config)

    # The reference comes from what transformers reads back from the files as written.
    model = (Gemma4ForConditionalGeneration if spelled_published else AutoModelForCausalLM).from_pretrained(
        folder, dtype=torch.float32
    )
    model.eval()
    generated2, logprobs, margins = reference(model, prompt)
    assert generated2 == generated, f"{name}: the saved spelling changes transformers' output"
    assert uncached_greedy(model, prompt, generated) == generated, f"{name}: cached != uncached in transformers"
    spelling = (
        "published (global_head_dim, gemma4 wrapper)" if spelled_published else "transformers 5 (per_layer_config)"
    )
    write_json(folder / "expected.json", greedy_record(seed, prompt, generated, logprobs, margins, spelling=spelling))
    print(f"{name}: seed {seed}, {folder_kb(folder)} KB, greedy {generated}")


# ---- the MLX layout ------------------------------------------------------------------


def tiny_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over the ids (mlx-lm's convert copies one along)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t2", "eos_token": "t1", "pad_token": "t0"}
        )
    )


def mlx_greedy(model, prompt: list[int]):
    """mlx-lm's model, its own caches, greedy: (ids, log-probs, top-2 margins)."""
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1].astype(mx.float32)
    ids, logprobs, margins = [], [], []
    for _ in range(NEW_TOKENS):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top2 = mx.sort(lp[0])[-2:]
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        logprobs.append(float(lp[0, token].item()))
        margins.append(float((top2[1] - top2[0]).item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1].astype(mx.float32)
    return ids, logprobs, margins


def make_mlx(source: str = "gemma4_moe", bits: int = 4, group_size: int = 32) -> None:
    import mlx.core as mx
    from mlx_lm.convert import convert
    from mlx_lm.utils import load_model

    src = OUT / source
    name = f"{source}_mlx_q{bits}"
    out = MLX_OUT / name
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        shutil.copytree(src, hf)
        config = json.loads((hf / "config.json").read_text())
        # mlx-lm 0.32 takes the wrapper's vocab size from the top level (262144 when absent).
        config["vocab_size"] = config["text_config"]["vocab_size"]
        config["torch_dtype"] = "bfloat16"
        (hf / "config.json").write_text(json.dumps(config, indent=2))
        tiny_tokenizer(hf, config["vocab_size"])
        convert(str(hf), str(out), quantize=True, q_bits=bits, q_group_size=group_size)
    for extra in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "README.md",
    ):
        (out / extra).unlink(missing_ok=True)

    model, _ = load_model(out)
    model.set_dtype(mx.float32)  # scales and unquantized weights are bf16 values: exact in float32
    vocab = config["vocab_size"]
    for seed in range(100):  # a prompt whose greedy picks are clear of near-ties at 4 bits
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
        ids, logprobs, margins = mlx_greedy(model, prompt)
        if min(margins) > 5e-3 and len(set(ids)) >= 5:
            break
    else:
        raise SystemExit(f"{name}: no prompt gave clear greedy margins")
    import mlx_lm

    expected = {
        "referee": f"mlx-lm {mlx_lm.__version__} (its own convert and greedy decoding)",
        "prompt_ids": prompt,
        "greedy_ids": ids,
        "logprobs": logprobs,
        "min_top2_margin": min(margins),
        "spelling": "mlx-lm convert of the published spelling, 4-bit",
        "compute_dtype": "float32",
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: {size // 1024} KB, greedy {ids}")


if __name__ == "__main__":
    names = sys.argv[1:] or [*VARIANTS, "mlx"]
    for n in names:
        if n == "mlx":
            for source in MLX_SOURCES:
                make_mlx(source)
        else:
            make(n)
