"""The shapes ``python -m engine bench --shape`` builds: published configs of the
architectures (the parts that shape compute and memory) and toy twins of them for CPU checks.

Apart from engine/cli/bench.py so that the media bench's shapes (engine/cli/bench_media.py)
can name a text shape here and add only their vision part.
"""

from __future__ import annotations

from typing import Any

# Published configs of the architectures (the parts that shape compute and memory).
# What Qwen/Qwen3.5-4B and Qwen/Qwen3.5-35B-A3B share: gated DeltaNet layers with every 4th
# layer full attention, and their partial, interleaved multimodal RoPE.
_QWEN3_5_LAYOUT: dict[str, Any] = dict(
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    # Multi-head latent attention + routed experts (a deepseek_v3 model), from
    # moonshotai/Moonlight-16B-A3B's config: 27 layers (1 dense), 64 experts top-6 + 2 shared.
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        vocab_size=163840,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "tiny-mla": dict(
        model_type="deepseek_v3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        moe_intermediate_size=64,
        vocab_size=256,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # Hybrid (gated DeltaNet + gated attention, every 4th layer full); text part of the
    # published Qwen/Qwen3.5-4B and Qwen/Qwen3.5-35B-A3B configs.
    "qwen3.5-4b": dict(
        model_type="qwen3_5",
        hidden_size=2560,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=9216,
        vocab_size=248320,
        rms_norm_eps=1e-6,
        **_QWEN3_5_LAYOUT,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
    ),
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe",
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        vocab_size=248320,
        rms_norm_eps=1e-6,
        **_QWEN3_5_LAYOUT,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
    ),
    # A tiny hybrid for checking the bench itself on a CPU.
    "tiny-qwen3.5": dict(
        model_type="qwen3_5",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=256,
        rms_norm_eps=1e-6,
        full_attention_interval=2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # OpenAI's gpt-oss-20b: 32 experts (4 active), sinks, sliding/full layers, YaRN.
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        rms_norm_eps=1e-5,
        sliding_window=128,
        rope_theta=150000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        swiglu_limit=7.0,
        attention_bias=True,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    # google/gemma-4-26B-A4B's text model (its config.json's text_config): 128 experts, 8
    # routed per token beside a dense MLP; global layers (every 6th) with keys as values.
    "gemma4-26b-a4b": dict(
        model_type="gemma4_text",
        hidden_size=2816,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        intermediate_size=2112,
        moe_intermediate_size=704,
        num_experts=128,
        top_k_experts=8,
        enable_moe_block=True,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        vocab_size=262144,
        sliding_window=1024,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,  # spelled out, as published
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
# The same architecture at toy size, to check the shape's code path on a CPU.
SHAPES["gemma4-tiny"] = {
    **SHAPES["gemma4-26b-a4b"],
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "top_k_experts": 2,
    "vocab_size": 512,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
# DiffusionGemma 26B-A4B (google/diffusiongemma-26B-A4B-it): Gemma 4 26B-A4B's MoE layers
# run as a causal prompt encoder and a bidirectional canvas decoder, blocks of 256 tokens
# (the dimensions mlx-vlm's DiffusionGemma config defaults to; engine/cli/bench_diffusion.py).
SHAPES["diffusion-gemma-26b-a4b"] = {
    **SHAPES["gemma4-26b-a4b"],
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "use_bidirectional_attention": "vision",
}
SHAPES["diffusion-gemma-tiny"] = {**SHAPES["gemma4-tiny"], "model_type": "diffusion_gemma", "canvas_length": 16}
# The same structure at a size the CPU build runs in seconds (checks, not speed).
SHAPES["tiny-gpt-oss"] = {
    **SHAPES["gpt-oss-20b"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "sliding_window": 8,
}
# The MoE hybrid at a size the CPU build runs in seconds (checks, not speed).
SHAPES["tiny-qwen3.5-moe"] = {
    **SHAPES["qwen3.5-35b-a3b"],
    **{k: v for k, v in SHAPES["tiny-qwen3.5"].items() if k != "model_type"},
    "intermediate_size": 0,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}
# An MoE whose experts are most of its weights, at a size the CPU build decodes in
# milliseconds: the expert-streaming bench's CPU figures (--resident-experts).
SHAPES["small-moe"] = dict(
    model_type="qwen3_moe",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    vocab_size=1024,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

# Modules a shape quantizes its own way whatever --bits says, as its published
# checkpoints do: gpt-oss ships its experts in MXFP4 (the rest follows --bits; 16 keeps
# it bf16, as the release has it).
FIXED_QUANTIZATION: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-oss-20b": (r"\.mlp\.experts\.(gate|up|down)_proj$", {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
}
FIXED_QUANTIZATION["tiny-gpt-oss"] = FIXED_QUANTIZATION["gpt-oss-20b"]


def attention_heads(config: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a shape: ``head_dim`` where the config gives it,
    else the hidden size over the heads."""
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads, int(config.get("num_key_value_heads", heads)), int(head_dim)
