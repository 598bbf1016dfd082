"""Make the reference outputs the model-family tests compare against.

Needs torch and transformers (the tests themselves do not). For each family it builds a
tiny random transformers model, stores its weights (bfloat16 on disk to stay small; the
reference runs in float32 on exactly those rounded values) with its config.json under
tests/golden/models/<name>/, and records in expected.json a fixed prompt, transformers'
greedy continuation and the log-probability of each chosen token.

    python tests/golden/make_model_goldens.py [name ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from golden_common import folder_kb, greedy_record, save_checkpoint, search_seed, write_config, write_json
from transformers import AutoConfig, AutoModelForCausalLM

OUT = Path(__file__).resolve().parent / "models"
PROMPT_LEN = 20
NEW_TOKENS = 12

# Small enough to run fast, big enough that every mechanism (GQA, sliding windows shorter
# than the prompt, local/global layers) takes part.
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}

# name -> (config, legacy_rope): legacy_rope rewrites config.json to the older
# rope_theta + rope_scaling spelling, so both spellings are covered.
VARIANTS: dict[str, tuple[dict, bool]] = {
    "llama": (dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0), True),
    "llama3_rope": (
        dict(
            model_type="llama",
            tie_word_embeddings=True,
            rope_parameters=LLAMA3_ROPE,
            attention_bias=True,
            mlp_bias=True,
            head_dim=32,
        ),
        False,
    ),
    "llama_dynamic": (
        dict(
            model_type="llama",
            vocab_size=128,
            max_position_embeddings=16,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
        True,
    ),
    "mistral": (dict(model_type="mistral", sliding_window=8, tie_word_embeddings=False, rope_theta=1e6), True),
    "qwen2": (dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6), True),
    "qwen3": (
        dict(
            model_type="qwen3",
            tie_word_embeddings=False,
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 1e6,
            },
        ),
        False,
    ),
    "qwen3_moe": (
        dict(
            model_type="qwen3_moe",
            tie_word_embeddings=False,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            rope_theta=1e6,
        ),
        False,
    ),
    "gemma2": (
        dict(
            model_type="gemma2",
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
            hidden_activation="gelu_pytorch_tanh",
            rope_theta=10000.0,
        ),
        True,
    ),
    "gemma3_text": (
        dict(
            model_type="gemma3_text",
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            num_hidden_layers=4,
            intermediate_size=96,
            vocab_size=160,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        False,
    ),
    "phi3": (
        dict(
            model_type="phi3",
            tie_word_embeddings=False,
            partial_rotary_factor=0.5,
            sliding_window=10,
            original_max_position_embeddings=16,
            rope_theta=10000.0,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.7, 2.5],
                "long_factor": [1.0, 2.0, 5.0, 12.0],
                "rope_theta": 10000.0,
            },
        ),
        False,
    ),
}


def build(name: str, overrides: dict, seed: int):
    torch.manual_seed(seed)
    settings = {**COMMON, **overrides}
    config = AutoConfig.for_model(**settings)
    config._attn_implementation = "eager"  # exact softmax path, soft-capping supported
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases start at constants: make them matter
                p.add_(0.1 * torch.randn_like(p))
            else:  # a wider spread than the default init, so logits are far from uniform
                p.normal_(0.0, 0.15)
            if "embed_tokens" in pname and config.model_type.startswith("gemma"):
                # Gemma scales embeddings by sqrt(hidden) and ties the output to them; at full
                # spread each token's own embedding dominates and greedy decoding only repeats.
                p.mul_(0.2)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # what the bf16 file will hold
    model.eval()
    return model


def reference(model, prompt: list[int]):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    generated = out.sequences[0, len(prompt) :].tolist()
    logprobs, margins = [], []
    for step, token in zip(out.logits, generated):
        lp = torch.log_softmax(step[0].double(), dim=-1)
        logprobs.append(float(lp[token]))
        top2 = torch.topk(lp, 2).values
        margins.append(float(top2[0] - top2[1]))
    return generated, logprobs, margins


def find_seed(name: str, make_model):
    """(model, seed, prompt, greedy ids, log-probs, top-2 margins) for the first seed whose
    ``make_model(seed)`` decodes clearly."""
    return search_seed(name, make_model, reference, PROMPT_LEN)


def make(name: str) -> None:
    overrides, legacy_rope = VARIANTS[name]
    model, seed, prompt, generated, logprobs, margins = find_seed(name, lambda s: build(name, overrides, s))

    folder = OUT / name
    config = save_checkpoint(model, folder)
    if legacy_rope:
        params = config.pop("rope_parameters", None) or {}
        config["rope_theta"] = params.pop("rope_theta", 10000.0)
        if params.get("rope_type", "default") != "default":
            config["rope_scaling"] = params
    write_config(folder, config)
    spelling = "rope_theta+rope_scaling" if legacy_rope else "rope_parameters"
    write_json(
        folder / "expected.json", greedy_record(seed, prompt, generated, logprobs, margins, rope_spelling=spelling)
    )
    print(f"{name}: seed {seed}, {folder_kb(folder)} KB, greedy {generated}")


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        make(n)
