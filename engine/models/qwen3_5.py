"""Qwen3.5 (text part): gated DeltaNet linear-attention layers mixed with gated full attention.

* Layer kinds come from ``layer_types`` (transformers 5) or ``full_attention_interval``
  (the published configs: every N-th layer is full attention).
* Full attention: ``q_proj`` yields each head's query and an output gate side by side;
  the attention output is multiplied by sigmoid(gate) before ``o_proj``. Per-head
  q/k RMSNorm, RoPE over the first ``partial_rotary_factor`` of each head (default 0.25).
  The multimodal RoPE sections (``mrope_section``, interleaved as in Qwen3-VL) only matter
  for image and video positions: on text all three ids are the same, which is plain RoPE.
  A prompt with media passes (3, 1, n) ``position_ids`` (``rope_index``, Qwen2.5-VL's
  layout; each video frame group its own span); the recurrent layers take no positions.
* Norms are (1 + w): Hugging Face checkpoints store w, and sanitize adds the 1 once, as
  mlx-lm's converted checkpoints already have it (told apart by the conv1d weight layout,
  [C, 1, K] on the Hub, [C, K, 1] in MLX). The gated norm inside DeltaNet is plain w.
* Recurrent layers keep a ``RecurrentCache`` (conv + delta-rule state), attention layers
  a ``KVCache``.

Also reads the multimodal checkpoints' text part (``text_config``, weights under
``model.language_model.``), leaving the vision tower to engine/media/qwen3_5 (Qwen3-VL's
tower without DeepStack) and the multi-token-prediction weights to ``Model.mtp``.
``qwen3_5_moe`` and ``qwen3_next`` build on this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts import config_spellings
from engine.models import qwen3_5_mtp, stacked
from engine.models.base import (
    NESTED_LM_PREFIXES,
    QKV,
    Attention,
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    GatedMLP,
    activation,
    make_rope,
    sdpa,
    strip_prefixes,
    text_config,
)
from engine.models.gated_delta import GatedDeltaNet
from engine.models.kv_cache import KVCache
from engine.models.qwen2_5_vl import Model as QwenVLModel
from engine.models.qwen2_5_vl import mrope_axes, rotate_mrope
from engine.models.qwen3_5_mtp import MTP_ONE_CENTRED, MTPHead
from engine.models.recurrent_cache import STEP_WINDOW, RecurrentCache
from engine.models.switch import stack_expert_weights

# Weights that are not part of the language model (vision tower); the multi-token-prediction
# layer's (mtp.*) are kept apart and load into ``Model.mtp`` (engine/models/qwen3_5_mtp.py).
OTHER_WEIGHTS = ("model.visual.", "visual.", "vision_tower.")
# Norms that compute x * (1 + w); Hugging Face checkpoints store w.
ONE_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


# A DeltaNet layer's projections of the same input (one matmul once stacked).
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen3_5_text"
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 248320
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    # Mixture of experts (qwen3_5_moe, qwen3_next); 0 experts = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    mtp_num_hidden_layers: int = 0
    # Interleaved multimodal RoPE over the rotated quarter of each head (t, h, w, t, ...).
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        flat = text_config(config)
        section = config_spellings.mrope_section(flat)
        # The Qwen3.5 / Qwen3-Next configs rotate a quarter of each head unless told otherwise.
        params = flat.get("rope_parameters")
        if "partial_rotary_factor" not in flat and not (isinstance(params, dict) and "partial_rotary_factor" in params):
            flat["partial_rotary_factor"] = 0.25
        flat = super().normalise(flat)
        scaling = flat.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type") == "mrope":  # text positions: plain RoPE
            flat["rope_scaling"] = None
        if flat.get("mlp_only_layers") is None:
            flat["mlp_only_layers"] = []
        if section is not None:
            flat["mrope_section"] = section
        return flat

    def kinds(self) -> list[str]:
        """Each layer's kind: "linear_attention" or "full_attention"."""
        n = self.num_hidden_layers
        if isinstance(self.layer_types, list) and len(self.layer_types) >= n:
            return [str(k) for k in self.layer_types[:n]]
        every = max(1, int(self.full_attention_interval))
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]

    def is_sparse(self, index: int) -> bool:
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % max(1, self.decoder_sparse_step) == 0
        )

    # Memory plan: only full-attention layers grow with the context; the recurrent ones
    # hold a fixed state (engine/models/base.py: kv_bytes_per_token, recurrent_state_bytes).
    def layer_windows(self) -> list[int | None]:
        return [None for k in self.kinds() if k == "full_attention"]

    def recurrent_state_bytes(self, dtype_bytes: int) -> int:
        conv_dim = (
            2 * self.linear_key_head_dim * self.linear_num_key_heads
            + self.linear_value_head_dim * self.linear_num_value_heads
        )
        per_layer = (
            (self.linear_conv_kernel_dim - 1) * conv_dim * dtype_bytes
            + self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim * 4
        )
        return per_layer * sum(1 for k in self.kinds() if k == "linear_attention")


class GatedAttention(Attention):
    """Full attention whose output is gated per channel by sigmoid of a second query half."""

    def __init__(self, args: ModelArgs):
        rope = make_rope(
            int(args.head_dim * args.partial_rotary_factor),
            args.rope_theta,
            args.rope_scaling,
            args.max_position_embeddings,
        )
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm_eps=args.rms_norm_eps,
        )
        self.q_proj = nn.Linear(
            args.hidden_size, 2 * args.num_attention_heads * args.head_dim, bias=args.attention_bias
        )
        # Multimodal RoPE (prompts with media): which of the three position ids rotates each
        # frequency of the rotated part.
        dims = int(args.head_dim * args.partial_rotary_factor)
        self._mrope_axes = mx.array(mrope_axes(args.mrope_section, dims // 2, interleaved=True))
        self._mrope_inv_freq = mx.array(1.0 / (args.rope_theta ** (np.arange(0, dims, 2, dtype=np.float32) / dims)))

    def __call__(self, x: mx.array, mask, cache, position_ids: mx.array | None = None) -> mx.array:
        q, gate, k, v = self.gated_qkv(x, cache.offset if cache is not None else 0, position_ids)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.gated_out(self.attend(q, k, v, mask), gate)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        """A short causal pass (a speculative verification: n queries, the keys up to the
        last) attends row by row, each query over exactly the keys its decode step saw:
        a GPU runs another attention kernel for several queries than for one, whose sums
        round otherwise, and the verification must give the numbers single steps give."""
        n, total = q.shape[2], k.shape[2]
        if not (1 < n <= STEP_WINDOW and isinstance(mask, str)):
            return sdpa(q, k, v, self.scale, mask)
        rows = [
            sdpa(q[:, :, t : t + 1], k[:, :, : total - n + t + 1], v[:, :, : total - n + t + 1], self.scale, None)
            for t in range(n)
        ]
        return mx.concatenate(rows, axis=2)

    def gated_qkv(
        self, x: mx.array, offset, position_ids: mx.array | None = None
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Rotated queries, the output gate, rotated keys and values ([B, heads, L, head_dim]
        but the gate, [B, L, heads, head_dim]); ``offset`` an int or a scalar array, or
        with media in the prompt, ``position_ids`` (three rows: multimodal RoPE)."""
        b, n, _ = x.shape
        d = self.head_dim
        q, k, v = stacked.project(self, QKV, x)  # one matmul for short inputs, once stacked
        q, gate = mx.split(q.reshape(b, n, self.n_heads, 2 * d), 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(b, n, self.n_kv_heads, d)).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, self.n_kv_heads, d).transpose(0, 2, 1, 3)
        if position_ids is not None:
            q = rotate_mrope(q, position_ids, self._mrope_axes, self._mrope_inv_freq)
            k = rotate_mrope(k, position_ids, self._mrope_axes, self._mrope_inv_freq)
            return q, gate, k, v
        return self.rope(q, offset), gate, self.rope(k, offset), v

    def gated_out(self, attn: mx.array, gate: mx.array) -> mx.array:
        b, _, n, _ = attn.shape
        out = attn.transpose(0, 2, 1, 3).reshape(b, n, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(b, n, -1)))


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's projections: q/k/v in one matrix, z, b and a each in their own (stacked
    into one matmul for short inputs by the compiled decode step)."""

    stacked_projections = (IN_PROJ,)

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size,
            args.linear_num_key_heads,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            args.linear_conv_kernel_dim,
            args.rms_norm_eps,
            activation(args.hidden_act),
        )
        h = args.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)

    def project(self, x: mx.array):
        b, n, _ = x.shape
        qkv, z, beta, a = stacked.project(self, IN_PROJ, x)
        return qkv, z.reshape(b, n, self.num_v_heads, self.head_v_dim), beta, a


class DecoderLayer(nn.Module):
    linear_class: type[GatedDeltaNet] = Qwen35GatedDeltaNet

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.is_linear = args.kinds()[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = self.linear_class(args)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = self.make_mlp(args, index)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.window = None  # no sliding windows; the stack's mask is the plain causal one

    def make_mlp(self, args: ModelArgs, index: int) -> nn.Module:
        return GatedMLP(args.hidden_size, args.intermediate_size, activation=activation(args.hidden_act))

    def __call__(self, x: mx.array, mask, cache, position_ids: mx.array | None = None) -> mx.array:
        if self.is_linear:
            h = x + self.linear_attn(self.input_layernorm(x), mask, cache)
        else:
            h = x + self.self_attn(self.input_layernorm(x), mask, cache, position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(DecoderStack):
    layer_class = DecoderLayer

    def make_layers(self, args: ModelArgs) -> list:
        return [self.layer_class(args, i) for i in range(args.num_hidden_layers)]

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        return self.run(inputs, cache, input_embeddings, position_ids=position_ids)


class Model(CausalLM):
    model_class = HybridModel
    # Called as listener(ids or None, final hidden states, first position) after each pass
    # with a cache: the built-in MTP drafter follows the target this way (engine/mtp_drafter.py).
    hidden_listener = None
    # Positions of a prompt with images or video: Qwen2.5-VL's 3-D layout.
    rope_index = staticmethod(QwenVLModel.rope_index)
    # Whether the weights come in the Hub's layout (conv kernels last, norms centred on 0);
    # None: sanitize tells from the conv weights it is given.
    hub_layout: bool | None = None

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        start = cache[0].offset if cache else 0
        h = self.model(inputs, cache, input_embeddings, position_ids)
        if self.hidden_listener is not None and cache is not None:
            self.hidden_listener(inputs if input_embeddings is None else None, h, start)
        return self.logits(h)

    def make_cache(self) -> list:
        return [RecurrentCache(2) if layer.is_linear else KVCache() for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = strip_prefixes(weights, NESTED_LM_PREFIXES + (("model.mtp.", "mtp."),), OTHER_WEIGHTS)
        hub_layout = self.hub_layout
        if hub_layout is None:  # told by whoever saw the whole checkpoint (a rank holding no conv layer)
            hub_layout = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
        for key, value in list(weights.items()):
            if key.endswith("conv1d.weight") and value.shape[-1] != 1:
                weights[key] = value.swapaxes(1, 2)  # [C, 1, K] -> MLX's [C, K, 1]
            elif hub_layout and key.endswith(ONE_CENTRED + MTP_ONE_CENTRED) and value.ndim == 1:
                weights[key] = value + 1.0
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                stack_expert_weights(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        if any(k.startswith("mtp.") for k in weights) and "mtp" not in self:
            # The checkpoint carries its multi-token-prediction layer: build it to load into.
            self.mtp = MTPHead(self.args, self.model.layer_class)
            for i, layer in enumerate(self.mtp.layers):
                if isinstance(getattr(layer, "mlp", None), nn.Module) and "switch_mlp" in layer.mlp:
                    stack_expert_weights(weights, f"mtp.layers.{i}.mlp", self.args.num_experts)
        return super().sanitize(weights)


# The memory plan asks the family how each stored weight is held (its MTP layer: only with MTP drafting).
resident_weight = qwen3_5_mtp.resident_weight
