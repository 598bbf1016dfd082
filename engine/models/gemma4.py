"""Gemma 4 text: ``gemma4_text``, and the language model of the multimodal ``gemma4``
checkpoints (settings under ``text_config``, weights under ``model.language_model.`` or
mlx-lm's ``language_model.model.``; the vision and audio towers' weights are skipped).

What sets it apart from Gemma 3:

* RMSNorm scales by ``weight`` itself (not 1 + weight); values are RMS-normalised too
  (no scale); attention scores are not scaled (scale 1).
* Global (full-attention) layers have their own head size and KV heads: the published
  configs say ``global_head_dim`` / ``num_global_key_value_heads`` (the latter only with
  ``attention_k_eq_v``), transformers 5 writes a ``per_layer_config`` table instead. With
  ``attention_k_eq_v`` global layers have no ``v_proj``: the raw key projection is the value.
* RoPE per layer type from ``rope_parameters``; "proportional" RoPE rotates the first
  ``partial_rotary_factor`` of each half of the head with frequencies spread over the
  whole head size, leaving the rest as is.
* Per-layer embeddings (PLE): a second token embedding, one slice per layer, mixed with
  a projection of the input embeddings and gated into each layer's output.
* KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each
  reuses those of the last earlier layer of its type. Only the owning layers have a
  cache (``make_cache`` returns fewer caches than layers).
* MoE layers run a routed expert block beside the dense MLP and add the two.
* Every layer's output is multiplied by a stored ``layer_scalar``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import EngineError, UnsupportedModelError
from engine.models.base import (
    NESTED_LM_PREFIXES,
    QKV,
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    GatedMLP,
    RoPE,
    activation,
    attention_mask,
    caches_for,
    make_rope,
    sdpa,
    strip_prefixes,
    text_config,
)
from engine.models.gemma3 import media_mask
from engine.models.stacked import project
from engine.models.switch import SwitchGLU

FULL, SLIDING = "full_attention", "sliding_attention"

# transformers' Gemma4TextConfig defaults, used for what a config leaves out.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma4_text"
    hidden_size: int = 2304
    num_hidden_layers: int = 30
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, dict[str, Any]] | None = None
    vocab_size: int = 262_144
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131_072
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    pad_token_id: int = 0
    use_bidirectional_attention: str | None = None  # "vision": image tokens see each other (sliding layers)
    # Media placeholder ids (from the multimodal wrapper): their per-layer embedding is the pad token's.
    media_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = text_config(config)
        if config.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError(
                "This Gemma 4 checkpoint attends both ways over the whole text (an embedding model); "
                "MLX Desk runs the generative Gemma 4 models."
            )
        n = int(config.get("num_hidden_layers") or cls.num_hidden_layers)
        kinds = config.get("layer_types")
        if not isinstance(kinds, list) or len(kinds) < n:
            kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]  # 5 local : 1 global
        kinds = [str(k) for k in kinds[:n]]
        kinds[-1] = FULL  # transformers forces the last layer global
        config["layer_types"] = kinds
        given = config.get("rope_parameters")
        if isinstance(given, dict) and given and not all(isinstance(v, dict) for v in given.values()):
            raise UnsupportedModelError(
                "Gemma 4's rope_parameters must give one block per layer type (full_attention, sliding_attention)."
            )
        given = given if isinstance(given, dict) else {}
        config["rope_parameters"] = {kind: dict(given.get(kind) or DEFAULT_ROPE[kind]) for kind in (FULL, SLIDING)}
        config["hidden_size_per_layer_input"] = int(config.get("hidden_size_per_layer_input") or 0)
        config["num_kv_shared_layers"] = int(config.get("num_kv_shared_layers") or 0)
        if config.get("global_head_dim") is None:
            config.pop("global_head_dim", None)
        if config.get("pad_token_id") is None:
            config.pop("pad_token_id", None)
        config["media_token_ids"] = [
            int(config[k])
            for k in ("image_token_id", "video_token_id", "audio_token_id")
            if isinstance(config.get(k), int)
        ]
        return config

    def __post_init__(self):
        owners = self.layer_types[: self.first_shared]
        if self.num_kv_shared_layers and (self.first_shared <= 0 or set(owners) != set(self.layer_types)):
            raise UnsupportedModelError(
                f"num_kv_shared_layers={self.num_kv_shared_layers} leaves a layer type without an earlier layer "
                "to share keys and values from; check config.json."
            )
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise UnsupportedModelError(
                "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size in config.json."
            )

    # -- the per-layer shape --------------------------------------------------------

    @property
    def first_shared(self) -> int:
        """Index of the first layer that reuses another layer's keys and values."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, index: int) -> int:
        """The layer whose keys and values layer ``index`` attends over (itself unless shared)."""
        if index < self.first_shared:
            return index
        kind = self.layer_types[index]
        return max(i for i in range(self.first_shared) if self.layer_types[i] == kind)

    def attention_shape(self, index: int) -> tuple[int, int]:
        """(head size, KV heads) of layer ``index``."""
        if self.per_layer_config is not None:  # transformers 5's spelling: the table is the whole truth
            own = self.per_layer_config.get(str(index)) or self.per_layer_config.get(index) or {}
            head_dim = own.get("head_dim", self.head_dim)
            return int(head_dim), int(own.get("num_key_value_heads", self.num_key_value_heads))
        if self.layer_types[index] != FULL:
            return self.head_dim, self.num_key_value_heads
        kv = self.num_global_key_value_heads if self.attention_k_eq_v and self.num_global_key_value_heads else None
        return self.global_head_dim, kv or self.num_key_value_heads

    def window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_types[index] == SLIDING else None

    def layer_windows(self) -> list[int | None]:
        return [self.window(i) for i in range(self.num_hidden_layers)]

    def kv_cache_layers(self) -> list[tuple[int | None, int, int]]:
        """(window, KV heads, head size) of each layer that holds a cache: the memory plan's
        input (shared layers hold none, global layers have their own shape)."""
        return [(self.window(i), *reversed(self.attention_shape(i))) for i in range(self.first_shared)]

    def rope_for(self, kind: str, head_dim: int) -> RoPE:
        params = dict(self.rope_parameters[kind])
        theta = float(params.pop("rope_theta", DEFAULT_ROPE[kind]["rope_theta"]))
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        if rope_type == "default":  # transformers' Gemma 4 rotates the whole head here
            return RoPE(head_dim, theta)
        if rope_type == "proportional":
            pairs = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
            factor = float(params.get("factor", 1.0))
            # Wavelengths (1 / inv_freq): frequencies over the whole head size; the pairs
            # past ``pairs`` get an infinite wavelength, i.e. no rotation.
            wavelengths = factor * theta ** (mx.arange(0, 2 * pairs, 2, dtype=mx.float32) / head_dim)
            rest = mx.full((head_dim // 2 - pairs,), mx.inf, dtype=mx.float32)
            return RoPE(head_dim, None, freqs=mx.concatenate([wavelengths, rest]))
        return make_rope(head_dim, theta, {"rope_type": rope_type, **params}, self.max_position_embeddings)


# ---- layers ------------------------------------------------------------------------


class Attention(nn.Module):
    """Queries always; keys and values only on layers that own them (``owns_kv``).

    Split into ``qkv`` / ``attend`` / ``out`` like base.AttentionSteps, so the compiled
    decode step can run a layer that owns its keys and values.
    """

    stacked_projections = (QKV,)  # one matmul where all three exist (not with keys as values)

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        kind = args.layer_types[index]
        self.head_dim, self.n_kv_heads = args.attention_shape(index)
        self.n_heads = args.num_attention_heads
        self.eps = args.rms_norm_eps
        self.owns_kv = index < args.first_shared
        self.k_is_v = args.attention_k_eq_v and kind == FULL
        d, bias, hidden = self.head_dim, args.attention_bias, args.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * d, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=self.eps)
        if self.owns_kv:
            self.k_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=bias)
            if not self.k_is_v:
                self.v_proj = nn.Linear(hidden, self.n_kv_heads * d, bias=bias)
            self.k_norm = nn.RMSNorm(d, eps=self.eps)
        self.o_proj = nn.Linear(self.n_heads * d, hidden, bias=bias)
        self.rope = args.rope_for(kind, d)

    def _heads(self, y: mx.array, n_heads: int) -> mx.array:
        return y.reshape(*y.shape[:2], n_heads, self.head_dim)

    def queries(self, q: mx.array, offset) -> mx.array:
        q = self.q_norm(self._heads(q, self.n_heads))
        return self.rope(q.transpose(0, 2, 1, 3), offset)

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys (both normed and rotated) and values (normed) [B, heads, L, head_dim]."""
        if self.k_is_v:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k
        else:
            q, k, v = project(self, QKV, x)
        k, v = self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
        k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset)
        v = mx.fast.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)
        return self.queries(q, offset), k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return sdpa(q, k, v, 1.0, mask)

    def out(self, attn: mx.array) -> mx.array:
        b, _, n, _ = attn.shape
        return self.o_proj(attn.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def __call__(self, x: mx.array, mask, cache, offset: int, shared: tuple[mx.array, mx.array] | None):
        """(output, (keys, values) attended over) for ``x`` [B, L, hidden]."""
        if shared is not None:
            q, (k, v) = self.queries(self.q_proj(x), offset), shared
        else:
            q, k, v = self.qkv(x, offset)
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
        return self.out(self.attend(q, k, v, mask)), (k, v)


class Router(nn.Module):
    """transformers: softmax over all experts, the top k renormalised, then scaled per
    expert. The same weights come from a softmax over the top k logits alone (the shared
    normaliser cancels), which skips a softmax over every expert."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k = args.top_k_experts
        self.eps = args.rms_norm_eps
        self.root = args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        logits = self.proj(x).astype(mx.float32)
        chosen = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.softmax(mx.take_along_axis(logits, chosen, axis=-1), axis=-1)
        return chosen, weights * self.per_expert_scale[chosen].astype(mx.float32)


class Experts(nn.Module):
    """The routed experts, stacked as mlx-lm's converter stores them (``switch_glu``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, activation(args.hidden_activation)
        )

    def __call__(self, x: mx.array, chosen: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.index = index
        self.window = args.window(index)
        self.self_attn = Attention(args, index)
        wide = args.use_double_wide_mlp and index >= args.first_shared
        act = activation(args.hidden_activation)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size * (2 if wide else 1), activation=act)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.moe = args.enable_moe_block
        if self.moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(h, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
        self.per_layer = bool(args.hidden_size_per_layer_input)
        if self.per_layer:
            self.act = act
            self.per_layer_input_gate = nn.Linear(h, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(h, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, mask, cache, offset: int, shared, per_layer_input: mx.array | None):
        attn, kv = self.self_attn(self.input_layernorm(x), mask, cache, offset, shared)
        return self.after_attention(x, attn, per_layer_input), kv

    def after_attention(self, x: mx.array, attn: mx.array, per_layer_input: mx.array | None) -> mx.array:
        """Residual, feed-forward (and experts), per-layer input, layer scale."""
        return self.unscaled_after_attention(x, attn, per_layer_input) * self.layer_scalar

    def unscaled_after_attention(self, x: mx.array, attn: mx.array, per_layer_input: mx.array | None) -> mx.array:
        """``after_attention`` before the layer scale (DiffusionGemma's encoder and decoder
        share a layer's weights but each stores its own scale)."""
        h = x + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:  # the router and experts read the block's input, not the MLP's
            chosen, weights = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), chosen, weights)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(out)
        if self.per_layer:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h

    def choose_experts(self, x: mx.array) -> mx.array:
        """The router's choice (it normalises its input itself, so the experts' normed input serves)."""
        return self.router(x)[0]


class SelfContainedLayer(DecoderLayer):
    """A layer that needs nothing beyond its input and its own cache (the model has no
    per-layer inputs and no shared keys and values, as in the 26B and 31B models): with
    ``finish`` the compiled decode step (engine/decode/compiled_step.py) can run it."""

    def finish(self, x: mx.array, attn_out: mx.array) -> mx.array:
        return self.after_attention(x, attn_out, None)


class Gemma4Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.args = args
        if args.hidden_size_per_layer_input:
            n, d = args.num_hidden_layers, args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * d)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * d, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def make_layers(self, args: ModelArgs) -> list:
        plain = not args.hidden_size_per_layer_input and not args.num_kv_shared_layers
        return [(SelfContainedLayer if plain else DecoderLayer)(args, i) for i in range(args.num_hidden_layers)]

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings scaled by sqrt(hidden) (the scale rounded to their dtype, as transformers does)."""
        h = self.embed_tokens(inputs)
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)

    def token_per_layer_inputs(self, inputs: mx.array) -> mx.array:
        """The per-layer embeddings of the ids [B, L, layers, d]; media placeholders read the pad token's."""
        args = self.args
        for media_id in args.media_token_ids:
            inputs = mx.where(inputs == media_id, args.pad_token_id, inputs)
        e = self.embed_tokens_per_layer(inputs)
        e = e * mx.array(args.hidden_size_per_layer_input**0.5, dtype=e.dtype)
        return e.reshape(*inputs.shape, args.num_hidden_layers, args.hidden_size_per_layer_input)

    def mix_per_layer_inputs(self, h: mx.array, per_token: mx.array) -> mx.array:
        """The per-layer inputs: a projection of the input embeddings plus the token's own."""
        args = self.args
        p = self.per_layer_model_projection(h) * (args.hidden_size**-0.5)
        p = self.per_layer_projection_norm(p.reshape(*h.shape[:-1], args.num_hidden_layers, -1))
        return (p + per_token) * (2.0**-0.5)

    def __call__(
        self,
        inputs: mx.array | None,
        cache=None,
        input_embeddings: mx.array | None = None,
        per_layer_inputs: mx.array | None = None,
        bidirectional: list[tuple[int, int]] | None = None,
    ) -> mx.array:
        """``bidirectional``: [start, end) runs of one image each, whose tokens attend to each
        other both ways on the sliding layers (transformers' "vision" mode; global layers
        stay causal)."""
        args = self.args
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        per_layer: list[Any] = [None] * len(self.layers)
        if args.hidden_size_per_layer_input:
            if per_layer_inputs is None:
                if inputs is None:
                    raise EngineError("Gemma 4 with per-layer embeddings needs the token ids along with embeddings.")
                per_layer_inputs = self.token_per_layer_inputs(inputs)
            mixed = self.mix_per_layer_inputs(h, per_layer_inputs)
            per_layer = [mixed[:, :, i] for i in range(len(self.layers))]
        cache = [None] * len(self.layers) if cache is None else list(cache)
        cache += [None] * (len(self.layers) - len(cache))  # shared layers hold no cache
        offset = cache[0].offset if cache[0] is not None else 0
        n = h.shape[1]
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, cache):  # owners come first, so each window's mask sees a cache
            if layer.window not in masks:
                if bidirectional and layer.window is not None:
                    masks[layer.window] = media_mask(c, n, layer.window, bidirectional)
                else:
                    masks[layer.window] = attention_mask(n, c, layer.window)
        kvs: dict[int, tuple[mx.array, mx.array]] = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            source = args.kv_source(i)
            h, kv = layer(h, masks[layer.window], c, offset, kvs.get(source) if source != i else None, per_layer[i])
            if i < args.first_shared:
                kvs[i] = kv
        return self.norm(h)


# Tower weights of the multimodal checkpoints, in transformers' and in mlx-lm's naming.
_TOWERS = tuple(
    prefix + name
    for prefix in ("model.", "")
    for name in ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.")
)
_KV_WEIGHTS = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.", ".self_attn.v_norm.")


class Model(CausalLM):
    model_class = Gemma4Model

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: mx.array | None = None,
        per_layer_inputs: mx.array | None = None,
        bidirectional: list[tuple[int, int]] | None = None,
    ) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings, per_layer_inputs, bidirectional))

    @property
    def bidirectional_media(self) -> bool:
        """Whether the prompt builder should pass each image's token run (see Gemma 3)."""
        return self.args.use_bidirectional_attention == "vision"

    @property
    def logit_softcap(self) -> float | None:
        return self.args.final_logit_softcapping

    def make_cache(self) -> list:
        """Caches for the layers that own keys and values only."""
        return caches_for([self.args.window(i) for i in range(self.args.first_shared)])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(strip_prefixes(weights, NESTED_LM_PREFIXES, _TOWERS))
        first_shared = self.args.first_shared
        out: dict[str, mx.array] = {}
        for key, value in weights.items():
            shared = key.startswith("model.layers.") and int(key.split(".")[2]) >= first_shared
            if shared and any(part in key for part in _KV_WEIGHTS):
                continue  # a shared layer's own K/V weights, which it never uses
            out[key] = value
        return unpack_experts(out)


def unpack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' fused expert tensors -> the ``switch_glu`` layout the layers load."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.endswith(".experts.gate_up_proj"):  # transformers: [experts, 2 * inner, hidden]
            base = key.removesuffix(".gate_up_proj") + ".switch_glu"
            half = value.shape[1] // 2
            out[f"{base}.gate_proj.weight"] = value[:, :half]
            out[f"{base}.up_proj.weight"] = value[:, half:]
        elif key.endswith(".experts.down_proj"):
            out[key.removesuffix(".down_proj") + ".switch_glu.down_proj.weight"] = value
        else:
            out[key] = value
    return out
