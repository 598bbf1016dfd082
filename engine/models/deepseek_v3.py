"""DeepSeek V3 / R1 (and the repos built on it: Kimi K2 as ``kimi_k2``, Moonlight).

Multi-head latent attention (``mla.py``: a query LoRA or none, YaRN with DeepSeek's
mscale, a cache of latents only), the first ``first_k_dense_replace`` layers dense, the
rest sigmoid-routed experts with group-limited routing and shared experts
(``routed_moe.py``). The multi-token-prediction layer the checkpoints append
(``num_nextn_predict_layers``) loads into ``Model.mtp`` for built-in drafting
(``deepseek_mtp.py``); further ones are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import UnsupportedModelError
from engine.models import routed_moe
from engine.models.base import BaseModelArgs, CausalLM, DecoderStack, GatedMLP, activation
from engine.models.deepseek_mtp import attach_mtp, mtp_module_path, nextn_part
from engine.models.deepseek_mtp import left_out as _left_out
from engine.models.mla import LatentAttention, latent_caches, split_kv_b
from engine.models.mla_cache import latent_bytes_per_token
from engine.models.routed_moe import RoutedMoE, stack_experts


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int | None = 1
    n_routed_experts: int | None = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None  # "dense" / "sparse" per layer (GLM's spelling)
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().normalise(config)
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config["n_routed_experts"] = config["num_local_experts"]
        if "num_nextn_predict_layers" not in config and "num_mtp_layers" in config:
            config["num_nextn_predict_layers"] = config["num_mtp_layers"]
        # DeepSeek V2's softmax / greedy routing under this model_type would run silently wrong.
        scoring, method = config.get("scoring_func", "sigmoid"), config.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or method != "noaux_tc":
            raise UnsupportedModelError(
                f"{config.get('model_type')} with scoring_func={scoring!r}, topk_method={method!r} is not supported; "
                "MLX Desk runs DeepSeek V3's sigmoid routing (scoring_func 'sigmoid', topk_method 'noaux_tc')"
            )
        return config

    def is_sparse(self, index: int) -> bool:
        if self.mlp_layer_types:
            return self.mlp_layer_types[index] == "sparse"
        return (
            bool(self.n_routed_experts)
            and index >= self.first_k_dense_replace
            and index % (self.moe_layer_freq or 1) == 0
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Every layer caches its latent and rope key, not per-head keys and values."""
        per_layer = latent_bytes_per_token(self.kv_lora_rank, self.qk_rope_head_dim, dtype_bytes)
        return self.num_hidden_layers * per_layer


# The memory plan asks the family which stored weights it holds in float32 (its routers).
held_in_float32 = routed_moe.held_in_float32


def resident_weight(name: str, n_layers: int) -> str | None:
    """How a stored weight is held once loaded (the memory plan counts what is resident):
    "mtp" for the MTP layer's (loaded for built-in drafting), None for what is left out
    (further MTP layers, the copies of embedding and head), "model" for the rest."""
    if _left_out(name, n_layers):
        return None
    return "mtp" if nextn_part(name, n_layers) is not None else "model"


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.self_attn = self.make_attention(args, index)
        if args.is_sparse(index):
            self.mlp = RoutedMoE(args)
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation=activation(args.hidden_act))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.window = None

    def make_attention(self, args: ModelArgs, index: int) -> nn.Module:
        return LatentAttention(args)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        """Everything after attention: residual, feed-forward, residual."""
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(DecoderStack):
    layer_class = DecoderLayer

    def make_layers(self, args: ModelArgs) -> list:
        return [self.layer_class(args, i) for i in range(args.num_hidden_layers)]


class Model(CausalLM):
    model_class = DeepseekV3Model
    # Called as listener(ids or None, final hidden states, first position) after each pass
    # with a cache: the built-in MTP drafter follows the target this way (engine/decode/mtp_drafter.py).
    hidden_listener = None

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        start = cache[0].offset if cache else 0
        h = self.model(inputs, cache, input_embeddings)
        if self.hidden_listener is not None and cache is not None:
            self.hidden_listener(inputs if input_embeddings is None else None, h, start)
        return self.logits(h)

    def _prepare_layer(self, weights: dict[str, mx.array], prefix: str) -> None:
        stack_experts(weights, f"{prefix}.mlp", self.args.n_routed_experts or 0)
        split_kv_b(weights, f"{prefix}.self_attn", self.args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = attach_mtp(self, super().sanitize(weights), self._prepare_layer)
        for i in range(self.args.num_hidden_layers):
            self._prepare_layer(weights, f"model.layers.{i}")
        return weights

    def adapter_module(self, path: str) -> str | None:
        """Where a module an adapter names lives here when its name alone cannot say: adapters
        trained on the checkpoint's layout name the MTP layer ``model.layers.N.*`` (N =
        num_hidden_layers), which loads (or waits unread) as ``mtp.*``; sanitize leaves a lone
        tensor of it out, as it would a layer stored only in part."""
        return mtp_module_path(path, self.args.num_hidden_layers)

    def make_cache(self) -> list:
        return latent_caches(len(self.layers))
