"""Reference outputs for the latent-attention and sigmoid-routed MoE families: DeepSeek V3
(and Kimi K2 / Moonlight's spellings of it), GLM-4.5-style MoE, GLM-4.7 Flash, GLM-5 (DSA).

Same recipe as make_model_goldens.py (tiny random transformers models, bf16 weights on
disk, float32 reference, clear greedy margins), plus what these families need:
the router's correction bias (a buffer the shared recipe leaves at zero) made random,
checks that transformers' cached and uncached runs agree, each family in transformers 5's
config spelling and in its published repos' spelling, and stand-in multi-token-prediction
tensors after the last layer where the published checkpoints carry them (the engine
must leave them out).

    python tests/golden/make_mla_goldens.py [name ...]
"""

from __future__ import annotations

import shutil
import sys

import torch
from golden_common import (
    folder_kb,
    fresh_folder,
    greedy_record,
    pretrained_files,
    search_seed,
    write_config,
    write_json,
)
from make_model_goldens import NEW_TOKENS, OUT, PROMPT_LEN, build, reference
from safetensors.torch import load_file, save_file

MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    num_hidden_layers=3,
    moe_intermediate_size=16,
    intermediate_size=96,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.8,
    "mscale_all_dim": 0.9,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "rope_theta": 5000.0,
}


def published(model_type: str | None = None, drop: tuple[str, ...] = (), add: dict | None = None):
    """Rewrite config.json the way the published repos spell it: rope_theta + rope_scaling
    (with the older "type" key), optionally another model_type alias."""

    def rewrite(config: dict) -> dict:
        params = config.pop("rope_parameters", None) or {}
        config["rope_theta"] = params.pop("rope_theta", 10000.0)
        if "partial_rotary_factor" in params:
            config["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        kind = params.pop("rope_type", "default")
        if kind != "default":
            config["rope_scaling"] = {"type": kind, **params}
        if model_type:
            config["model_type"] = model_type
        for key in drop:
            config.pop(key, None)
        config.update(add or {})
        return config

    return rewrite


# name -> (overrides, config rewrite or None, MTP stand-in layers to append)
VARIANTS: dict[str, tuple[dict, object, int]] = {
    "deepseek_v3": (
        dict(
            model_type="deepseek_v3",
            **MLA,
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.7,
            first_k_dense_replace=1,
            attention_bias=True,
            rope_parameters=YARN,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
        ),
        None,
        0,
    ),
    # Moonlight's shape of DeepSeek V3: no query LoRA, plain RoPE, one expert group.
    "moonlight": (
        dict(
            model_type="deepseek_v3",
            **MLA,
            q_lora_rank=None,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.4,
            first_k_dense_replace=2,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
        published(add={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}),
        1,
    ),
    # Kimi K2's repos say model_type "kimi_k2" and YaRN in the old spelling.
    "kimi_k2": (
        dict(
            model_type="deepseek_v3",
            **MLA,
            q_lora_rank=40,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.8,
            first_k_dense_replace=1,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
        published("kimi_k2"),
        1,
    ),
    "glm4_moe": (
        dict(
            model_type="glm4_moe",
            num_hidden_layers=3,
            head_dim=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            norm_topk_prob=False,
            moe_intermediate_size=16,
            intermediate_size=96,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.75},
        ),
        None,
        0,
    ),
    # GLM-4.5 / 4.6 / 4.7's repos: rope_theta and partial_rotary_factor at the top level.
    "glm4_moe_published": (
        dict(
            model_type="glm4_moe",
            num_hidden_layers=3,
            head_dim=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            use_qk_norm=False,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=2,
            moe_intermediate_size=16,
            intermediate_size=96,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
        published(),
        1,
    ),
    "glm4_moe_lite": (
        dict(
            model_type="glm4_moe_lite",
            **MLA,
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_interleave=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        None,
        0,
    ),
    # GLM-4.7 Flash's repo: first_k_dense_replace instead of mlp_layer_types.
    "glm4_moe_lite_published": (
        dict(
            model_type="glm4_moe_lite",
            **MLA,
            q_lora_rank=24,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            routed_scaling_factor=1.8,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        published(drop=("mlp_layer_types",), add={"first_k_dense_replace": 1}),
        1,
    ),
    # GLM-5: the indexer keeps 8 of up to 32 keys, so it really selects; layer 1 reuses layer 0's choice.
    "glm_moe_dsa": (
        dict(
            model_type="glm_moe_dsa",
            **MLA,
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            routed_scaling_factor=2.2,
            first_k_dense_replace=1,
            index_topk=8,
            index_head_dim=24,
            index_n_heads=8,
            indexer_types=["full", "shared", "full"],
            rope_parameters={"rope_type": "default", "rope_theta": 8000.0},
        ),
        None,
        0,
    ),
    # An indexer in every layer, as GLM-5's first release and mlx-lm have it; rope_parameters
    # is that repo's own spelling.
    "glm_moe_dsa_every_layer": (
        dict(
            model_type="glm_moe_dsa",
            **MLA,
            q_lora_rank=32,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            index_topk=8,
            index_head_dim=32,
            index_n_heads=8,
            indexer_types=["full", "full", "full"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        None,
        0,
    ),
    # The published spelling: the full/shared pattern from index_topk_freq (F F S F here).
    "glm_moe_dsa_published": (
        dict(
            model_type="glm_moe_dsa",
            **{**MLA, "num_hidden_layers": 4},
            q_lora_rank=24,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=2,
            index_topk=6,
            index_head_dim=32,
            index_n_heads=6,
            index_topk_freq=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        published(drop=("indexer_types", "mlp_layer_types", "layer_types"), add={"index_topk_freq": 2}),
        1,
    ),
}


def randomise_buffers(model) -> None:
    """The routers' correction bias is a buffer: give it values that change the choice."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((0.3 * torch.randn_like(buf)).to(torch.bfloat16).to(torch.float32))


def uncached_agrees(model, prompt: list[int], generated: list[int], logprobs: list[float]) -> float:
    """Worst log-prob gap between the cached greedy run and one uncached forward pass."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    worst = 0.0
    for step, token in enumerate(generated):
        lp = torch.log_softmax(logits[len(prompt) - 1 + step].double(), dim=-1)
        if int(lp.argmax()) != token:
            return float("inf")
        worst = max(worst, abs(float(lp[token]) - logprobs[step]))
    return worst


def index_margin(model, ids: list[int]) -> float:
    """Smallest gap, over every DSA indexer and query, between the last key chosen and the
    first left out. ReLU'd scores tie at exactly 0 easily; a tie there makes the choice
    (and so the answer) arbitrary, so such seeds are refused."""
    worst = float("inf")
    real_topk = torch.Tensor.topk

    def spy(scores, k, *args, **kwargs):
        nonlocal worst
        if scores.dim() == 3:  # the indexer's [batch, queries, keys]; routers' are 2-D
            s = scores.double().masked_fill(scores < -1e30, float("-inf"))
            ordered = s.sort(dim=-1, descending=True).values
            crowded = (s > float("-inf")).sum(-1) > k
            if crowded.any():
                worst = min(worst, float((ordered[..., k - 1] - ordered[..., k])[crowded].min()))
        return real_topk(scores, k, *args, **kwargs)

    torch.Tensor.topk = spy
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        torch.Tensor.topk = real_topk
    return worst


def mtp_standins(config: dict, n: int) -> dict[str, torch.Tensor]:
    """Tensors named like DeepSeek V3 / GLM's MTP layers: model.layers.{N}.{enorm, hnorm,
    eh_proj, shared_head.norm, shared_head.head, embed_tokens, ...}."""
    # (shared_head.head and embed_tokens are vocab-sized: left out to keep the golden small.)
    h, first = config["hidden_size"], config["num_hidden_layers"]
    out = {}
    for i in range(first, first + n):
        p = f"model.layers.{i}"
        out[f"{p}.enorm.weight"] = torch.ones(h)
        out[f"{p}.hnorm.weight"] = torch.ones(h)
        out[f"{p}.eh_proj.weight"] = torch.zeros(h, 2 * h)
        out[f"{p}.shared_head.norm.weight"] = torch.ones(h)
        out[f"{p}.input_layernorm.weight"] = torch.ones(h)
        out[f"{p}.self_attn.o_proj.weight"] = torch.zeros(h, 8)
        out[f"{p}.mlp.experts.0.up_proj.weight"] = torch.zeros(8, h)
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def make(name: str) -> None:
    overrides, rewrite, mtp = VARIANTS[name]
    found = {}

    def accept(seed, model, prompt, generated, logprobs) -> bool:
        gap = uncached_agrees(model, prompt, generated, logprobs)
        found["margin"] = index_margin(model, prompt + generated)
        if gap < 1e-4 and found["margin"] > 1e-3:
            return True
        print(f"{name}: seed {seed}: cached/uncached gap {gap}, indexer margin {found['margin']}; next seed")
        return False

    def make_model(seed: int):
        model = build(name, overrides, seed)
        randomise_buffers(model)
        return model

    model, seed, prompt, generated, logprobs, margins = search_seed(
        name, make_model, reference, PROMPT_LEN, prompt_seed=2000, accept=accept
    )
    margin = found["margin"]

    folder = fresh_folder(OUT / name)
    config, tmp = pretrained_files(model)
    tensors = load_file(str(tmp / "model.safetensors"))
    shutil.rmtree(tmp)
    if mtp:
        tensors.update(mtp_standins(config, mtp))
        config["num_nextn_predict_layers"] = mtp
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    if rewrite is not None:
        config = rewrite(config)
    write_config(folder, config)
    expected = greedy_record(
        seed,
        prompt,
        generated,
        logprobs,
        margins,
        rope_spelling="rope_parameters" if rewrite is None else "rope_theta+rope_scaling",
        new_tokens=NEW_TOKENS,
    )
    if margin != float("inf"):
        expected["min_index_margin"] = margin
    write_json(folder / "expected.json", expected)
    print(f"{name}: seed {seed}, {folder_kb(folder)} KB, greedy {generated}")


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        make(n)
