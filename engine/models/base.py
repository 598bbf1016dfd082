"""Pieces every model family shares: config reading, RoPE variants, masks, attention.

Weight names follow the Hugging Face checkpoints, so a family's module tree mirrors
transformers' (``model.layers.N.self_attn.q_proj`` ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.artifacts.config_fields import from_known_keys
from engine.artifacts.config_spellings import partial_rotary_factor, rope_settings, text_config  # noqa: F401  (families read them from here)
from engine.errors import UnsupportedModelError
from engine.models import decode_attention_cuda, head_norm_rope_cuda
from engine.models.cache_buffers import KV, split_kv
from engine.models.kv_cache import KVCache, RotatingKVCache
from engine.models.quantized_routing import embedding_logits, linear, linear_plus
from engine.models.stacked import project, stacked_normed

# ---- configuration ------------------------------------------------------------------


@dataclass
class BaseModelArgs:
    """Shared loader: ``from_dict`` takes a config.json dict and ignores unknown keys."""

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Hook for families: turn the raw dict into field values (rope, defaults)."""
        config = text_config(config)
        theta, scaling = rope_settings(config, default_theta=cls._default_theta())
        config["rope_theta"] = theta
        config["rope_scaling"] = scaling
        config["partial_rotary_factor"] = partial_rotary_factor(config)
        return config

    @classmethod
    def _default_theta(cls) -> float:
        for f in dataclasses.fields(cls):
            if f.name == "rope_theta" and f.default is not dataclasses.MISSING:
                return float(f.default)
        return 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]):
        values = cls.normalise(dict(config))
        try:
            return from_known_keys(cls, values)
        except TypeError as exc:  # a required setting is missing
            raise UnsupportedModelError(
                f"config.json lacks a setting this model needs ({exc}); check that the file is complete."
            ) from None


def layer_types(config: dict[str, Any], n_layers: int, default: list[str]) -> list[str]:
    """Per-layer "full_attention" / "sliding_attention", from ``layer_types`` when present."""
    given = config.get("layer_types")
    if isinstance(given, list) and len(given) >= n_layers:
        return [str(t) for t in given[:n_layers]]
    return default


# ---- rotary position embeddings ------------------------------------------------------


class RoPE(nn.Module):
    """Rotary embedding over the first ``dims`` features (transformers' rotate-half layout).

    ``freqs`` (optional) are per-pair wavelengths over 2*pi, i.e. 1 / inv_freq, which is
    what ``mx.fast.rope`` takes. ``out_scale`` multiplies the rotated features, the way
    transformers multiplies cos/sin by its "attention factor" (YaRN, LongRoPE).
    ``traditional`` rotates adjacent pairs instead (DeepSeek's interleaved layout).
    """

    traditional = False

    def __init__(
        self, dims: int, base: float | None, scale: float = 1.0, freqs: mx.array | None = None, out_scale: float = 1.0
    ):
        super().__init__()
        self.dims = dims
        self.base = None if freqs is not None else base
        self.scale = scale
        self._freqs = freqs
        self.out_scale = out_scale

    def _rope(self, x: mx.array, offset: int, freqs: mx.array | None, base: float | None) -> mx.array:
        y = mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset, freqs=freqs
        )
        if self.out_scale != 1.0:
            if self.dims == x.shape[-1]:
                y = y * self.out_scale
            else:
                y = mx.concatenate([y[..., : self.dims] * self.out_scale, y[..., self.dims :]], axis=-1)
        return y

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return self._rope(x, offset, self._freqs, self.base)


class DynamicNTKRoPE(RoPE):
    """transformers' "dynamic" scaling: past the trained length the base grows with the length."""

    # A position's rotation depends on the length of the pass that computes it, so keys
    # computed in another request's pass are not the ones this request would compute.
    length_dependent = True

    def __init__(self, dims: int, base: float, factor: float, max_position_embeddings: int):
        super().__init__(dims, base)
        self.factor = factor
        self.max_pos = max_position_embeddings
        self.exact_until = max_position_embeddings  # passes ending here or sooner rotate alike
        self.pass_end = 0  # set by a chunked prefill: where its one pass would end (see prefill)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        seq_len = max(offset + x.shape[-2], self.pass_end)
        base = self.base
        if seq_len > self.max_pos:
            grow = self.factor * seq_len / self.max_pos - (self.factor - 1)
            base = base * grow ** (self.dims / (self.dims - 2))
        return self._rope(x, offset, None, base)


class LongRoPE(RoPE):
    """Phi-3's LongRoPE ("longrope"/"su"): short factors up to the trained length, long beyond."""

    length_dependent = True  # as DynamicNTKRoPE's: the factors follow the pass's last position

    def __init__(self, dims: int, base: float, short_factor, long_factor, original_max: int, out_scale: float):
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        wavelengths = base**exponents
        super().__init__(dims, None, freqs=mx.array(short_factor, mx.float32) * wavelengths, out_scale=out_scale)
        self._long = mx.array(long_factor, mx.float32) * wavelengths
        self.original_max = original_max
        self.exact_until = original_max
        self.pass_end = 0

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        # transformers picks one set for the whole forward pass from its last position.
        long = max(offset + x.shape[-2], self.pass_end) > self.original_max
        return self._rope(x, offset, self._long if long else self._freqs, None)


def length_dependent_ropes(model: Any) -> list[Any]:
    """The model's RoPE modules whose rotation follows the length of the pass (dynamic NTK,
    LongRoPE): each has ``exact_until`` (passes ending there or sooner all rotate alike) and
    ``pass_end`` (a chunked prefill sets it to where one pass over the prompt would end).

    Found once per model and kept beside its parameters (not one of them): walking a 36-layer
    model's modules takes about 3 ms, and every prefill asks."""
    found = vars(model).get("_length_dependent_ropes")
    if found is None:
        found = [m for _, m in model.named_modules() if getattr(m, "length_dependent", False)]
        object.__setattr__(model, "_length_dependent_ropes", found)
    return found


def _inv_freq(dims: int, base: float) -> mx.array:
    return 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))


def make_rope(dims: int, base: float, scaling: dict[str, Any] | None, max_position_embeddings: int | None) -> RoPE:
    """The RoPE variant a config asks for (linear, dynamic, llama3, yarn, longrope)."""
    if scaling is None:
        return RoPE(dims, base)
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return RoPE(dims, base, scale=1.0 / factor)
    if kind == "dynamic":
        return DynamicNTKRoPE(dims, base, factor, int(max_position_embeddings or 2048))
    if kind == "llama3":
        inv = _inv_freq(dims, base)
        old_len = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv
        scaled = mx.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = mx.where(medium, smoothed, scaled)
        return RoPE(dims, None, freqs=1.0 / inv)
    if kind == "yarn":
        original = float(scaling["original_max_position_embeddings"])
        if not scaling.get("factor"):
            factor = float(max_position_embeddings) / original

        def mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
        beta_fast = float(scaling.get("beta_fast") or 32)
        beta_slow = float(scaling.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dims - 1)
        if lo == hi:
            hi += 0.001
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - lo) / (hi - lo), 0, 1)
        keep = 1 - ramp  # 1 where frequencies are left unscaled
        pos = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        inv = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
        return RoPE(dims, None, freqs=1.0 / inv, out_scale=float(attn))
    if kind in ("longrope", "su"):
        original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
        if not scaling.get("factor"):
            factor = float(max_position_embeddings) / original
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return LongRoPE(dims, base, scaling["short_factor"], scaling["long_factor"], original, float(attn))
    raise UnsupportedModelError(
        f"RoPE scaling {kind!r} is not supported; supported: linear, dynamic, llama3, yarn, longrope."
    )


# ---- masks and attention -------------------------------------------------------------


def attention_mask(n_queries: int, cache, window: int | None = None):
    """Mask for a forward pass of ``n_queries`` tokens, computed before the cache update.

    None when no mask is needed (one token), "causal" when the fast kernel's own
    causal mask is right, else a boolean [queries, keys] array (sliding windows).
    """
    if cache is None:
        return KVCache().make_mask(n_queries, window)
    return cache.make_mask(n_queries, window)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    # A decode step's or verify pass's few queries over a short cache split the keys across
    # the GPU on CUDA, where MLX's kernel takes one block per head (models.decode_attention_cuda).
    if decode_attention_cuda.takes(q, k, v, mask):
        return decode_attention_cuda.attend(q, k, v, scale)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def softcapped_attention(q, k, v, scale: float, mask, softcap: float) -> mx.array:
    """Attention with tanh soft-capping of the scores (Gemma 2), which the fast kernel lacks."""
    b, n_heads, n_q, d = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    q = (q * scale).reshape(b, n_kv, rep, n_q, d)
    scores = q @ k[:, :, None].swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        n_k = k.shape[2]
        mask = mx.arange(n_k)[None, :] <= (mx.arange(n_q)[:, None] + n_k - n_q)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    out = weights @ v[:, :, None]
    return out.reshape(b, n_heads, n_q, -1)


QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def rotated_qkv(
    attn: nn.Module, x: mx.array, offset, norm: nn.Module | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys (both rotated) and values [B, heads, L, head_dim] of an attention
    module with ``q_proj``/``k_proj``/``v_proj``, ``n_heads``, ``n_kv_heads``, ``head_dim``,
    ``rope`` and, when ``qk_norm``, ``q_norm``/``k_norm``; of ``norm(x)`` where a norm is
    given (in the stacked product's prologue where the CUDA kernel takes it)."""
    q, kv = rotated_q_kv(attn, x, offset, norm)
    return (q, *split_kv(kv))


def rotated_q_kv(attn: nn.Module, x: mx.array, offset, norm: nn.Module | None = None) -> tuple[mx.array, KV]:
    """``rotated_qkv`` with keys and values as the heads kernel gives them: stacked [2, B,
    heads, L, head_dim], which a KV cache of one buffer writes with one update, or a pair."""
    b, n, _ = x.shape
    nq, nkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    y, x = stacked_normed(attn, QKV, x, norm)
    if y is not None and head_norm_rope_cuda.enabled() and head_norm_rope_cuda.fits(attn, y, type(attn.rope) is RoPE):
        # The norms (where the family has them), both rotations and the split into heads in
        # one CUDA kernel: up to four launches and six views fewer a layer.
        return head_norm_rope_cuda.head_norm_rope(attn, y, offset)
    if y is None:
        q = attn.q_proj(x).reshape(b, n, nq, d)
        k = attn.k_proj(x).reshape(b, n, nkv, d)
        v = attn.v_proj(x).reshape(b, n, nkv, d).transpose(0, 2, 1, 3)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        return attn.rope(q, offset), (attn.rope(k, offset), v)
    heads = y.reshape(b, n, nq + 2 * nkv, d)
    if attn.qk_norm:
        q, k, v = mx.split(heads, [nq, nq + nkv], axis=2)
        q, k = attn.q_norm(q).transpose(0, 2, 1, 3), attn.k_norm(k).transpose(0, 2, 1, 3)
        return attn.rope(q, offset), (attn.rope(k, offset), v.transpose(0, 2, 1, 3))
    # Without per-head norms, queries and keys rotate together: one kernel, and each
    # head's rotation depends only on its own values and the positions.
    heads = heads.transpose(0, 2, 1, 3)
    qk = attn.rope(heads[:, : nq + nkv], offset)
    return qk[:, :nq], (qk[:, nq:], heads[:, nq + nkv :])


# Up to this many queries (a decode step, a verify pass) attention reads a quantized KV
# cache as stored, where the backend does that well (quantized_kv_cache.READS_CODES);
# longer passes (prefill) dequantize it once for the fast kernel.
QUANTIZED_READ_QUERIES = 32


def cached_attention(attn: AttentionSteps, q: mx.array, k: mx.array, v: mx.array, cache, mask) -> mx.array:
    """Append ``k``/``v`` to ``cache`` and attend ``q`` over it with ``attn.attend``."""
    return cached_attention_kv(attn, q, (k, v), cache, mask)


def cached_attention_kv(attn: AttentionSteps, q: mx.array, kv: KV, cache, mask) -> mx.array:
    """``cached_attention`` of keys and values stacked or as a pair (``KV``): a stack goes into
    a cache of one buffer with one write.

    A quantized KV cache is read without dequantizing when the pass is short and the
    attention is the plain one (no sinks or soft caps, which only ``attend`` knows)."""
    if cache is None:
        return attn.attend(q, *split_kv(kv), mask)
    if getattr(cache, "attends_prefix", False):  # a batch's shared prefix (plain attention only)
        return cache.attend_with_prefix(q, *split_kv(kv), attn.scale, mask)
    if (
        getattr(cache, "reads_codes", False)  # first: other caches' queries may not be one array (MLA)
        and type(attn).attend is AttentionSteps.attend
        and q.shape[2] <= QUANTIZED_READ_QUERIES
        and cache.attends_quantized(*split_kv(kv))
    ):
        cache.store(*split_kv(kv))
        return cache.attend(q, attn.scale, mask)
    if isinstance(kv, mx.array) and getattr(cache, "stacks_kv", False):
        k, v = cache.update_and_fetch_stacked(kv)
    else:
        k, v = cache.update_and_fetch(*split_kv(kv))
    return attn.attend(q, k, v, mask)


class AttentionSteps(nn.Module):
    """Attention split into steps, so a compiled decode step can run everything but the
    attention itself (whose key count changes every token) inside traced functions.

    Subclasses provide ``qkv``, ``o_proj`` and ``scale``; ``attend`` may be replaced.
    """

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        q, kv = self.q_kv(x, cache.offset if cache is not None else 0)
        return self.out(cached_attention_kv(self, q, kv, cache, mask))

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys (both rotated) and values, shaped [B, heads, L, head_dim].
        ``offset`` (int or scalar array) is the position of the first token."""
        raise NotImplementedError

    def normed_qkv(self, x: mx.array, norm: nn.Module, offset) -> tuple[mx.array, mx.array, mx.array]:
        """``self.qkv(norm(x), offset)``; the shared attention takes the norm into its stacked
        product's prologue where the CUDA kernel can (one launch fewer a layer)."""
        return self.qkv(norm(x), offset)

    def q_kv(self, x: mx.array, offset, norm: nn.Module | None = None) -> tuple[mx.array, KV]:
        """Queries and ``KV`` (keys and values stacked or as a pair) of ``norm(x)``, or of ``x``
        without a norm: what ``cached_attention_kv`` takes."""
        q, k, v = self.qkv(x, offset) if norm is None else self.normed_qkv(x, norm, offset)
        return q, (k, v)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return sdpa(q, k, v, self.scale, mask)

    def out(self, attn: mx.array) -> mx.array:
        """The output projection of attention results shaped [B, heads, L, head_dim]."""
        return linear(self.o_proj, heads_as_rows(attn))

    def out_plus(self, attn: mx.array, residual: mx.array) -> mx.array:
        """``residual + self.out(attn)``, the add in the output product's epilogue where the
        CUDA kernel takes it (``linear_plus``)."""
        if type(self).out is not AttentionSteps.out:  # a family's own output step
            return residual + self.out(attn)
        return linear_plus(self.o_proj, heads_as_rows(attn), residual)


def heads_as_rows(attn: mx.array) -> mx.array:
    """Attention results [B, heads, L, head_dim] as rows [B, L, heads * head_dim]. One token's
    heads already lie in that order, so a decode step takes one view where a pass takes two
    (each a node the host builds and hands over every step)."""
    b, _, n, _ = attn.shape
    if n == 1:
        return attn.reshape(b, 1, -1)
    return attn.transpose(0, 2, 1, 3).reshape(b, n, -1)


class Attention(AttentionSteps):
    """Multi-head attention with grouped KV heads, as in Llama, Qwen2/3, Mistral and Gemma."""

    stacked_projections = (QKV,)
    norm_class = nn.RMSNorm  # of the per-head query/key norms

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RoPE,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(hidden_size, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:  # Qwen3, Gemma 3: RMSNorm over each head before RoPE
            self.q_norm = self.norm_class(head_dim, eps=qk_norm_eps)
            self.k_norm = self.norm_class(head_dim, eps=qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        self.rope = rope

    def qkv(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        return rotated_qkv(self, x, offset)

    def normed_qkv(self, x: mx.array, norm: nn.Module, offset) -> tuple[mx.array, mx.array, mx.array]:
        if type(self).qkv is not Attention.qkv:  # a family's own q/k/v step
            return self.qkv(norm(x), offset)
        return rotated_qkv(self, x, offset, norm)

    def q_kv(self, x: mx.array, offset, norm: nn.Module | None = None) -> tuple[mx.array, KV]:
        if type(self).qkv is not Attention.qkv:  # a family's own q/k/v step
            return super().q_kv(x, offset, norm)
        return rotated_q_kv(self, x, offset, norm)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for most families, GeGLU for Gemma."""

    stacked_projections = (GATE_UP,)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation=nn.silu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return linear(self.down_proj, self.gated(x))

    def plus(self, residual: mx.array, x: mx.array, norm: nn.Module | None = None) -> mx.array:
        """``residual + self(norm(x))`` (``self(x)`` without a norm), the add in the down
        product's epilogue where the CUDA kernel takes it (``linear_plus``), the norm as
        ``gated`` takes it: launches fewer a layer in a decode step."""
        return linear_plus(self.down_proj, self.gated(x, norm), residual)

    def gated(self, x: mx.array, norm: nn.Module | None = None) -> mx.array:
        """``act(gate(n)) * up(n)`` of ``n = norm(x)`` (x without a norm): for SiLU, in the
        stacked gate/up product's epilogue where the CUDA kernel takes it, and the norm in its
        prologue where it takes that too (up to two launches fewer a layer in a decode step)."""
        if self.activation is nn.silu:
            fused, x = stacked_normed(self, GATE_UP, x, norm, glu=True)
            if fused is not None:
                return fused
        elif norm is not None:
            x = norm(x)
        gate, up = project(self, GATE_UP, x)
        return self.activation(gate) * up


def activation(name: str | None):
    """The activation function a config names (hidden_act / hidden_activation)."""
    name = (name or "silu").lower()
    table = {
        "silu": nn.silu,
        "swish": nn.silu,
        "gelu": nn.gelu,
        "gelu_pytorch_tanh": nn.gelu_approx,
        "gelu_new": nn.gelu_approx,
        "gelu_fast": nn.gelu_approx,
        "relu": nn.relu,
    }
    if name not in table:
        raise UnsupportedModelError(f"Activation {name!r} is not supported; supported: {', '.join(sorted(table))}.")
    return table[name]


# ---- caches and memory -----------------------------------------------------------------


def caches_for(windows: list[int | None]) -> list:
    """One cache per layer: a rotating one where the layer attends over a sliding window."""
    return [KVCache() if w is None else RotatingKVCache(max_size=w) for w in windows]


# ---- the decoder stack and the causal LM around it ----------------------------------------


# Multimodal checkpoints nest the language model under one of these prefixes (the Hub's
# language_model.*, transformers 5's model.language_model.* in memory).
NESTED_LM_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", ""),
)


def strip_prefixes(
    weights: dict[str, mx.array], prefixes: tuple[tuple[str, str], ...], drop: tuple[str, ...]
) -> dict[str, mx.array]:
    """Multimodal checkpoints nest the language model: rename its weights by the first
    matching (old, new) prefix, and leave out the towers' weights (names starting ``drop``)."""
    renamed: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.startswith(drop):
            continue
        for old, new in prefixes:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    return renamed


class DecoderStack(nn.Module):
    """Token embeddings, the decoder layers (each with a ``window``: None or its sliding
    window), and the final norm. Families build the layers (``make_layers``)."""

    norm_class = nn.RMSNorm
    # A DFlash drafter's hook (engine.decode.dflash_drafter): when set, every cached pass
    # hands it the outputs of the layers it names (``layer_ids``, in ascending order; the
    # last layer's after the final norm, as transformers reports it) and the pass's first
    # position. Off (None) unless a request drafts with DFlash.
    layer_tap: Any = None

    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = self.make_layers(args)
        self.norm = self.norm_class(args.hidden_size, eps=args.rms_norm_eps)

    def make_layers(self, args) -> list:
        raise NotImplementedError

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings exactly as ``__call__`` uses them (for splicing media in)."""
        return self.embed_tokens(inputs)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.run(inputs, cache, input_embeddings)

    def run(
        self, inputs: mx.array, cache, input_embeddings: mx.array | None, make_mask=attention_mask, **layer_kwargs
    ) -> mx.array:
        """The forward pass; ``make_mask(n_queries, cache, window)`` gives each window's
        mask, and ``layer_kwargs`` go to every layer."""
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        n = h.shape[1]
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, cache):
            if layer.window not in masks:  # one mask per window size, before any update
                masks[layer.window] = make_mask(n, c, layer.window)
        tap = self.layer_tap
        if tap is None or cache[0] is None:
            for layer, c in zip(self.layers, cache):
                h = layer(h, masks[layer.window], c, **layer_kwargs)
            return self.norm(h)
        start, taken = cache[0].offset, []
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, masks[layer.window], c, **layer_kwargs)
            if i in tap.layer_ids:
                taken.append(h)
        out = self.norm(h)
        if len(self.layers) - 1 in tap.layer_ids:  # transformers' last hidden state is the normed one
            taken[-1] = out
        tap(taken, start)
        return out


class CausalLM(nn.Module):
    """A ``DecoderStack`` (``model_class``) under ``model.`` with an ``lm_head``, or the
    embedding matrix when ``tie_word_embeddings``: the interface every family exposes."""

    model_class: type[DecoderStack]

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.model_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings))

    @property
    def logit_softcap(self) -> float | None:
        """tanh soft-capping of the final logits (Gemma 2), None for none."""
        return None

    def logits(self, h: mx.array) -> mx.array:
        """Logits from the final (already normalised) hidden states."""
        if self.args.tie_word_embeddings:
            logits = embedding_logits(self.model.embed_tokens, h)
        else:
            logits = linear(self.lm_head, h)
        cap = self.logit_softcap
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def head(self, h: mx.array) -> mx.array:
        """Logits from the last layer's output (final norm included)."""
        return self.logits(self.model.norm(h))

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings exactly as ``__call__`` would use them (for splicing media in)."""
        return self.model.embed(inputs)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    def make_cache(self) -> list:
        return caches_for([layer.window for layer in self.layers])

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens
