"""GLM-4.7 Flash (``glm4_moe_lite``): DeepSeek V3's layers (multi-head latent attention,
sigmoid-routed experts with a correction bias and a shared expert) at GLM's sizes.

Which layers are dense comes from ``mlp_layer_types`` (transformers 5's spelling) or
``first_k_dense_replace`` (the published repo's); either way one leading dense layer by
default.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models import deepseek_v3


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    model_type: str = "glm4_moe_lite"
    vocab_size: int = 154880
    hidden_size: int = 2048
    intermediate_size: int = 10240
    moe_intermediate_size: int = 1536
    num_hidden_layers: int = 47
    num_attention_heads: int = 20
    n_routed_experts: int | None = 64
    routed_scaling_factor: float = 1.8
    q_lora_rank: int | None = 768
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int = 4
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5


class Model(deepseek_v3.Model):
    pass


resident_weight = deepseek_v3.resident_weight  # its MTP layer loads as DeepSeek V3's does
held_in_float32 = deepseek_v3.held_in_float32
