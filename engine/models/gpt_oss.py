"""gpt-oss (OpenAI's open-weight MoE models).

What sets it apart from Llama: every attention head has a learned "sink" logit that
joins the softmax but carries no value (so a head can attend to nothing); layers
alternate sliding-window and full attention (``layer_types``); RoPE is YaRN-scaled;
q/k/v/o carry biases. The feed-forward is a mixture of experts: a biased router picks
the top-k experts and softmaxes their logits; each expert is a clamped SwiGLU with
biases, ``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

Checkpoints come in three layouts, all loaded here:
- OpenAI's release: experts in MXFP4 (``*_blocks`` of packed e2m1 nibbles and
  ``*_scales`` of e8m0 exponents, [experts, out, in/32, ...]), which is exactly MLX's
  ``mxfp4`` quantization once the bytes are viewed as 32-bit words;
- transformers' own (bf16): ``gate_up_proj`` [experts, in, 2 * inter] with gate and up
  interleaved column by column, ``down_proj`` [experts, inter, in];
- mlx-lm's: ``experts.{gate,up,down}_proj`` stacked [experts, out, in], maybe quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from engine.errors import ModelLoadError
from engine.models import base, llama
from engine.models.switch import SwitchGLU, top_k_ids

# transformers' GptOssConfig falls back to this YaRN when a config names no RoPE at all.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "gpt_oss"
    hidden_size: int = 2880
    num_hidden_layers: int = 36
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    rope_theta: float = 150000.0
    attention_bias: bool = True
    sliding_window: int | None = 128
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = base.text_config(config)
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config["rope_scaling"] = dict(DEFAULT_ROPE)
        config = super().normalise(config)
        # transformers maps num_experts onto num_local_experts. (OpenAI's configs also
        # carry experts_per_token, which transformers ignores: so does this.)
        if "num_local_experts" not in config and "num_experts" in config:
            config["num_local_experts"] = config["num_experts"]
        return config

    def default_layer_types(self) -> list[str]:
        # Even layers (0, 2, ...) slide, odd ones attend to everything.
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)]


class Attention(base.Attention):
    """Biased GQA attention whose softmax also takes one learned sink logit per head."""

    def __init__(self, args: ModelArgs, rope: base.RoPE):
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
        )
        self.sinks = mx.zeros((args.num_attention_heads,))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.scale, mask=mask, sinks=self.sinks.astype(q.dtype)
        )


class ClampedSwitchGLU(SwitchGLU):
    """gpt-oss experts: SwiGLU with a sigmoid gain ``alpha``, clamped at ``limit``, and up + 1."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int, alpha: float, limit: float):
        super().__init__(dims, hidden_dims, num_experts, bias=True)
        self.alpha, self.limit = alpha, limit

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, self.limit)
        up = mx.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * mx.sigmoid(gate * self.alpha))


class MoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = ClampedSwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts, args.swiglu_alpha, args.swiglu_limit
        )

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.router(x)
        chosen = top_k_ids(logits, self.top_k)
        # Softmax over the chosen experts' logits only (not over all experts, then renormalised).
        weights = mx.softmax(mx.take_along_axis(logits, chosen, axis=-1).astype(mx.float32), axis=-1)
        y = self.experts(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def choose_experts(self, x: mx.array) -> mx.array:
        return top_k_ids(self.router(x), self.top_k)


class DecoderLayer(llama.DecoderLayer):
    def make_attention(self, args: ModelArgs, rope: base.RoPE) -> nn.Module:
        return Attention(args, rope)

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return MoeBlock(args)


class GptOssModel(llama.LlamaModel):
    layer_class = DecoderLayer


class Model(llama.Model):
    model_class = GptOssModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        out: dict[str, mx.array] = {}
        for key, value in weights.items():
            head, _, leaf = key.rpartition(".experts.")
            if not head:
                out[key] = value
                continue
            prefix = f"{head}.experts"
            if leaf in ("gate_up_proj_blocks", "down_proj_blocks"):
                if key.replace("_blocks", "_scales") not in weights:
                    raise ModelLoadError(f"the checkpoint has {key} but not its scales; download it again")
                # [E, out, in/32, 16] (or [E, out, in/2]) bytes -> [E, out, in/8] words:
                # MLX's mxfp4 packing, low nibble first, as OpenAI packs them.
                value = value.reshape(*value.shape[:2], -1).view(mx.uint32)
                leaf = leaf.replace("_blocks", ".weight")
            elif leaf in ("gate_up_proj_scales", "down_proj_scales"):
                leaf = leaf.replace("_scales", ".scales")
            elif leaf in ("gate_up_proj", "down_proj"):  # transformers' [E, in, out]
                value = value.swapaxes(-1, -2)
                leaf += ".weight"
            elif leaf in ("gate_up_proj_bias", "down_proj_bias"):
                leaf = leaf.replace("_bias", ".bias")
            else:  # already mlx-lm's layout
                out[key] = value
                continue
            proj, _, part = leaf.partition(".")
            if proj == "down_proj":
                out[f"{prefix}.down_proj.{part}"] = value
            else:  # gate and up interleave along the output axis (axis 1)
                out[f"{prefix}.gate_proj.{part}"] = mx.contiguous(value[:, 0::2])
                out[f"{prefix}.up_proj.{part}"] = mx.contiguous(value[:, 1::2])
        return out
