"""Make the reference outputs for the hybrid families (recurrent layers beside attention):
Qwen3.5 (dense and MoE), Qwen3-Next, LFM2 and LFM2-MoE.

Needs torch, transformers and mlx-lm (the tests need none of them). For each family it
builds a tiny random transformers model with non-default settings, stores its weights
(bfloat16; the reference runs in float32 on exactly those rounded values) under
tests/golden/models/<name>/ with:

* config.json: transformers 5's own spelling (``layer_types``, ``rope_parameters``);
* config.published.json: the spelling of the published repos (Qwen/Qwen3.5-*: a
  ``text_config`` wrapper with ``full_attention_interval`` and the mrope section;
  Qwen3-Next: flat ``rope_theta`` / ``partial_rotary_factor``; LiquidAI/LFM2-*:
  ``full_attn_idxs``, ``block_ff_dim``, ``tie_embedding``);
* expected.json: an 80-token prompt (longer than transformers' 64-token delta-rule
  chunk), transformers' greedy continuation, each chosen token's log-probability and the
  top-2 margins; transformers' cached and uncached greedy are checked to agree first;
* mlx/: mlx-lm's own conversion of the published spelling, 4-bit (group 32), and
  mlx/expected.json with mlx-lm's greedy ids and log-probs on it (float32 compute).

    python tests/golden/make_hybrid_goldens.py [name ...]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from golden_common import folder_kb, greedy_record, save_checkpoint, search_seed, write_config, write_json
from make_model_goldens import NEW_TOKENS
from make_model_goldens import reference as greedy_reference
from transformers import AutoConfig, AutoModelForCausalLM

OUT = Path(__file__).resolve().parent / "models"
PROMPT_LEN = 80  # past transformers' 64-token chunks of the delta rule

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

QWEN_LINEAR = dict(
    intermediate_size=64,
    num_hidden_layers=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    linear_conv_kernel_dim=3,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)

QWEN35_ROPE = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "partial_rotary_factor": 0.25,
    "mrope_section": [1, 1, 0],
    "mrope_interleaved": True,
}

VARIANTS: dict[str, dict] = {
    "qwen3_5": dict(QWEN_LINEAR, model_type="qwen3_5_text", tie_word_embeddings=False, rope_parameters=QWEN35_ROPE),
    "qwen3_5_moe": dict(
        QWEN_LINEAR,
        model_type="qwen3_5_moe_text",
        tie_word_embeddings=True,
        rope_parameters=QWEN35_ROPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    ),
    "qwen3_next": dict(
        QWEN_LINEAR,
        model_type="qwen3_next",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "lfm2": dict(
        model_type="lfm2",
        intermediate_size=96,
        num_hidden_layers=4,
        norm_eps=1e-5,
        conv_L_cache=3,
        conv_bias=False,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        tie_word_embeddings=True,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe",
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        norm_eps=1e-5,
        conv_L_cache=3,
        conv_bias=False,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        use_expert_bias=True,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


def build(overrides: dict, seed: int):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**COMMON, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms, biases, A_log, dt_bias: make their values matter
                p.add_(0.1 * torch.randn_like(p))
            else:  # a wider spread than the default init, so logits are far from uniform
                p.normal_(0.0, 0.15)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # what the bf16 file will hold
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2-MoE's routing bias starts at zero
                b.copy_((0.05 * torch.randn_like(b)).to(torch.bfloat16).to(torch.float32))
    model.eval()
    return model


def reference(model, prompt: list[int]):
    """transformers' greedy ids, log-probs and top-2 margins (make_model_goldens.reference),
    after checking that its cached decoding agrees with one uncached pass."""
    generated, logprobs, margins = greedy_reference(model, prompt)
    with torch.no_grad():
        full = model(torch.tensor([prompt + generated[:-1]]), use_cache=False).logits[0, len(prompt) - 1 :]
    assert full.argmax(-1).tolist() == generated, "transformers: cached and uncached greedy differ"
    return generated, logprobs, margins


def published(name: str, config: dict) -> dict:
    """The spelling the published checkpoints use for the same model."""
    c = json.loads(json.dumps(config))
    for key in (
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "output_router_logits",
        "router_aux_loss_coef",
        "use_cache",
    ):
        c.pop(key, None)
    if name.startswith("qwen3_5"):
        kinds = c.pop("layer_types")
        c["full_attention_interval"] = kinds.index("full_attention") + 1
        tie = c["tie_word_embeddings"]  # the published configs say it at both levels
        c["model_type"] = name + "_text"
        c["attn_output_gate"] = True
        c["mtp_num_hidden_layers"] = 1
        return {
            "architectures": [
                "Qwen3_5ForConditionalGeneration" if name == "qwen3_5" else "Qwen3_5MoeForConditionalGeneration"
            ],
            "model_type": name,
            "text_config": c,
            "tie_word_embeddings": tie,
            "image_token_id": 248056,
            "video_token_id": 248057,
            "vision_config": {"depth": 1, "hidden_size": 32, "model_type": name, "out_hidden_size": 64},
        }
    if name == "qwen3_next":
        kinds = c.pop("layer_types")
        c["full_attention_interval"] = kinds.index("full_attention") + 1
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope["rope_theta"]
        c["partial_rotary_factor"] = rope["partial_rotary_factor"]
        c["rope_scaling"] = None
        return c
    # LFM2: attention layer indices, the feed-forward width as block_ff_dim, tie_embedding.
    kinds = c.pop("layer_types")
    c["full_attn_idxs"] = [i for i, k in enumerate(kinds) if k == "full_attention"]
    c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    c["tie_embedding"] = c.pop("tie_word_embeddings")
    if name == "lfm2":
        c["block_ff_dim"] = c.pop("intermediate_size")
        c["block_dim"] = c["conv_dim"] = c["conv_dim_out"] = c["hidden_size"]
    return c


def published_weights(name: str, weights: dict) -> dict:
    """Weight names as the published multimodal checkpoints store them (Qwen3.5 only),
    with a vision and an MTP tensor that a text model must leave out."""
    if not name.startswith("qwen3_5"):
        return weights
    weights = dict(weights)
    if name == "qwen3_5_moe":  # the published MoE checkpoints store each block's experts fused
        for prefix in sorted({k.split(".experts.")[0] for k in weights if ".experts." in k}):
            n = len({k for k in weights if k.startswith(prefix + ".experts.") and k.endswith("down_proj.weight")})
            gate_up = [
                torch.cat(
                    [
                        weights.pop(f"{prefix}.experts.{e}.gate_proj.weight"),
                        weights.pop(f"{prefix}.experts.{e}.up_proj.weight"),
                    ]
                )
                for e in range(n)
            ]
            down = [weights.pop(f"{prefix}.experts.{e}.down_proj.weight") for e in range(n)]
            weights[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
            weights[f"{prefix}.experts.down_proj"] = torch.stack(down)
    out = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in weights.items()
    }
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    out["mtp.fc.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    return out


def mlx_lm_reference(folder: Path, prompt: list[int]) -> dict:
    """Convert the published spelling with mlx-lm (4-bit, group 32) and record mlx-lm's own
    greedy decoding of it, computed in float32 like the transformers reference."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from safetensors.torch import save_file

    target = folder / "mlx"
    if target.exists():
        shutil.rmtree(target)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        shutil.copy(folder / "config.published.json", src / "config.json")
        from safetensors.torch import load_file

        save_file(published_weights(folder.name, load_file(folder / "model.safetensors")), src / "model.safetensors")
        model, config = load_model(src)
        model, config = quantize_model(model, config, 32, 4)
        save_model(target, model)
        save_config(config, target / "config.json")
    model, _ = load_model(target)

    def upcast(p):
        return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(upcast, model.parameters()))
    for _, m in model.named_modules():  # quantized layers keep scales/biases as plain members
        if isinstance(m, nn.QuantizedLinear) or hasattr(m, "scales"):
            m.scales = upcast(m.scales)
            if getattr(m, "biases", None) is not None:
                m.biases = upcast(m.biases)
    ids, logprobs = [], []
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for (token, lp), _ in zip(
        generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=sampler), range(NEW_TOKENS)
    ):
        token = int(token)
        ids.append(token)
        logprobs.append(float(lp[token]))
    expected = {
        "mlx_lm_version": __import__("mlx_lm").__version__,
        "bits": 4,
        "group_size": 32,
        "prompt_ids": prompt,
        "greedy_ids": ids,
        "logprobs": logprobs,
    }
    (target / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    return expected


def make(name: str) -> None:
    overrides = VARIANTS[name]
    model, seed, prompt, generated, logprobs, margins = search_seed(
        name, lambda s: build(overrides, s), reference, PROMPT_LEN
    )

    folder = OUT / name
    config = save_checkpoint(model, folder)
    write_config(folder, config)
    write_json(folder / "config.published.json", published(name, config), sort_keys=True)
    write_json(folder / "expected.json", greedy_record(seed, prompt, generated, logprobs, margins))
    mlx = mlx_lm_reference(folder, prompt)
    print(f"{name}: seed {seed}, {folder_kb(folder)} KB, greedy {generated}, mlx-lm 4-bit {mlx['greedy_ids']}")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(VARIANTS):
        make(n)
