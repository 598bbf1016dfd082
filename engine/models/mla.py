"""Multi-head latent attention (MLA): DeepSeek V2/V3, Kimi K2, Moonlight, GLM-4.7 Flash, GLM-5.

Keys and values come from one small latent per token (``kv_lora_rank`` values) plus one
rotated key shared by all heads (``qk_rope_head_dim`` values); only those are cached
(``MLALatentCache``). ``kv_b_proj`` expands the latent into per-head no-RoPE keys and
values; it is split at load time, as mlx-lm does, into

* ``embed_q`` [heads, kv_lora_rank, qk_nope_head_dim]: the key half, and
* ``unembed_out`` [heads, v_head_dim, kv_lora_rank]: the value half,

so MLX checkpoints converted by mlx-lm load as they are. A few queries (decode,
speculative verification) use the absorbed form: queries move into the latent space
(``q_nope @ W_k``), attend over the cached latents directly as one shared key/value head,
and the result leaves it through ``unembed_out``. A long prompt expands the latents
instead, which costs less when there are about as many queries as keys. The RoPE part of
the scores is computed separately and enters the fused attention as its additive mask
(or, where MLX has no fused kernel for these head sizes, the epilogue of the one product
of the composed form: ``composed_latent_attention``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.base import RoPE, make_rope
from engine.models.mla_cache import MLALatentCache
from engine.models.stacked import project

# Up to this many queries per pass attend in the latent space (the absorbed form): every
# decode step and every speculative verify pass (as for stacked projections and quantized
# KV reads, 32 rows), so a verify pass computes its rows in a step's form; the expanded one
# rounds otherwise, and with 8 drafts (9 queries) bf16 greedy output parted from plain
# greedy. The absorbed form also costs less there: per key and head it reads
# kv_lora_rank + rope dims per query, where expanding costs 2 x kv_lora_rank x head dims
# per key whatever the queries (DeepSeek V3's sizes: equal near 170 queries).
ABSORB_MAX_QUERIES = 32


class MultiLinear(nn.Module):
    """One [out, in] matrix per head: x [B, heads, L, in] -> [B, heads, L, out]."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ (self.weight.swapaxes(-1, -2) if transpose else self.weight)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        heads, out_dims, in_dims = self.weight.shape
        q = QuantizedMultiLinear(in_dims, out_dims, heads, group_size, bits, mode)
        parts = mx.quantize(self.weight, q.group_size, q.bits, mode=mode)
        q.weight, q.scales = parts[0], parts[1]
        if len(parts) > 2:
            q.biases = parts[2]
        return q


class QuantizedMultiLinear(nn.Module):
    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_heads: int,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ):
        super().__init__()
        self.mode = mode
        parts = mx.quantize(mx.zeros((num_heads, output_dims, input_dims)), group_size, bits, mode=mode)
        self.weight, self.scales = parts[0], parts[1]
        if len(parts) > 2:
            self.biases = parts[2]
        # The packed layout tells the group size and bits actually used (None picks defaults).
        self.bits = self.weight.shape[-1] * 32 // input_dims
        self.group_size = input_dims // self.scales.shape[-1]
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


# Which absorbed attention to run: None picks by backend (composed_latent_attention); the
# bench sets it to compare the two on one machine.
COMPOSE: bool | None = None


def composed_latent_attention() -> bool:
    """Whether absorbed attention composes its own few kernels instead of calling MLX's fused
    attention. The fused call has no kernel for kv_lora_rank-sized heads (512) with an
    additive mask on the CUDA and CPU backends (MLX 0.32) and falls back to five separate
    ops there; Metal keeps the fused call, whose kernels may cover the case."""
    if COMPOSE is not None:
        return COMPOSE
    return not _on_metal()


@functools.cache
def _on_metal() -> bool:
    return mx.metal.is_available()


def mla_rope(args: Any) -> RoPE:
    """RoPE over the ``qk_rope_head_dim`` features; DeepSeek's checkpoints pair adjacent
    features (``rope_interleave``, the default), which is MLX's "traditional" layout."""
    rope = make_rope(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
    rope.traditional = bool(getattr(args, "rope_interleave", True))
    return rope


def mla_scale(args: Any) -> float:
    """Softmax scale: 1/sqrt(query head dim), times YaRN's mscale(factor, mscale_all_dim)
    squared when the config scales RoPE that way (DeepSeek V3, Kimi K2)."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    scaling = args.rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim") or 0
    factor = float(scaling.get("factor") or 1.0)
    if all_dim and factor > 1:
        m = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def causal_keep(mask, n_queries: int, n_keys: int) -> mx.array | None:
    """The attention mask as booleans [queries, keys] (True = may attend), or None."""
    if mask is None:
        return None
    if isinstance(mask, str):
        return mx.arange(n_keys)[None, :] <= (mx.arange(n_queries)[:, None] + n_keys - n_queries)
    return mask


class MLAttention(nn.Module):
    """Multi-head latent attention with HF weight names (``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``o_proj``)."""

    def __init__(self, args: Any):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dims, self.rope_dims, self.v_dims = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        q_dims = self.n_heads * (self.nope_dims + self.rope_dims)
        hidden, bias = args.hidden_size, args.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_dims, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            # transformers builds both latent norms with its default eps, not rms_norm_eps.
            self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_dims, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dims, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.embed_q = MultiLinear(self.nope_dims, self.kv_lora_rank, self.n_heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, self.v_dims, self.n_heads)
        self.o_proj = nn.Linear(self.n_heads * self.v_dims, hidden, bias=bias)
        self.rope = mla_rope(args)
        self.scale = mla_scale(args)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        offset = cache.offset if cache is not None else 0
        first, kv = self.input_projections(x)
        q_nope, q_pe, _ = self.queries(x, offset, first)
        latent, k_pe = self.latents(x, offset, kv)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        return self.attend_all(q_nope, q_pe, latent, k_pe, causal_keep(mask, x.shape[1], latent.shape[2]))

    def input_projections(self, x: mx.array) -> tuple[mx.array | None, mx.array | None]:
        """``x``'s first query projection and ``kv_a_proj_with_mqa(x)`` when computed
        together (see ``LatentAttention``); here (None, None): each is computed where used."""
        return None, None

    def queries(self, x: mx.array, offset, first: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array | None]:
        """No-RoPE and rotated query parts [B, heads, L, dims], and the query latent
        (``q_a_layernorm(q_a_proj(x))``, None without a query LoRA) that DSA indexers read.
        ``first`` is ``x``'s first query projection (``q_proj`` or ``q_a_proj``) when
        already computed."""
        b, n, _ = x.shape
        if self.q_lora_rank is None:
            resid, q = None, self.q_proj(x) if first is None else first
        else:
            resid = self.q_a_layernorm(self.q_a_proj(x) if first is None else first)
            q = self.q_b_proj(resid)
        q = q.reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.nope_dims], axis=-1)
        return q_nope, self.rope(q_pe, offset), resid

    def latents(self, x: mx.array, offset, kv: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """What the cache keeps for the new tokens: normed latents [B, 1, L, kv_lora_rank]
        and rotated shared keys [B, 1, L, qk_rope_head_dim]. ``kv`` is
        ``kv_a_proj_with_mqa(x)`` when already computed."""
        b, n, _ = x.shape
        kv = self.kv_a_proj_with_mqa(x) if kv is None else kv
        latent, k_pe = mx.split(kv, [self.kv_lora_rank], axis=-1)
        latent = self.kv_a_layernorm(latent).reshape(b, 1, n, self.kv_lora_rank)
        k_pe = self.rope(k_pe.reshape(b, 1, n, self.rope_dims), offset)
        return latent, k_pe

    def rope_scores(self, q_pe, k_pe, keep, scaled: bool = False) -> mx.array:
        """The RoPE part of the scores [B, heads, L, keys], scaled, with -inf-like values
        where ``keep`` says no: the fused attention's additive mask. ``scaled``: ``q_pe``
        is already multiplied by the softmax scale."""
        scores = (q_pe if scaled else q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if keep is not None:
            scores = mx.where(keep, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        return scores

    def latent_attention(self, q_latent, q_pe, latent, k_pe, keep, scaled: bool = False) -> mx.array:
        """The absorbed form: queries already in the latent space [B, heads, L, kv_lora_rank]
        attend over the latents as one shared key/value head; the result stays there.
        ``scaled``: ``q_pe`` is already multiplied by the softmax scale."""
        if not composed_latent_attention():
            mask = self.rope_scores(q_pe, k_pe, keep, scaled)
            return mx.fast.scaled_dot_product_attention(q_latent, latent, latent, scale=self.scale, mask=mask)
        # What MLX's fused call falls back to for these head sizes, in fewer kernels: all
        # heads' queries as the rows of one product with the shared latents, with the
        # scale and the RoPE scores applied in that product's epilogue (``addmm``: alpha
        # and beta), then softmax and the weighted sum. Same math, no separate multiply or
        # add; the scores are rounded once instead of three times.
        pe = q_pe @ k_pe.swapaxes(-1, -2)
        if keep is not None:
            pe = mx.where(keep, pe, mx.array(mx.finfo(pe.dtype).min, pe.dtype))
        b, h, n, r = q_latent.shape
        scores = mx.addmm(
            pe.reshape(b, 1, h * n, -1),
            q_latent.reshape(b, 1, h * n, r),
            latent.swapaxes(-1, -2),
            alpha=self.scale,
            beta=1.0 if scaled else self.scale,
        )
        weights = mx.softmax(scores, axis=-1, precise=True)
        return (weights @ latent).reshape(b, h, n, r)

    def output(self, heads: mx.array) -> mx.array:
        """The output projection of per-head values [B, heads, L, v_head_dim]."""
        b, _, n, _ = heads.shape
        return self.o_proj(heads.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def attend_all(self, q_nope, q_pe, latent, k_pe, keep) -> mx.array:
        """Attention over all cached tokens, ``keep`` [..., queries, keys] saying which
        each query may see (None: all), then the output projection."""
        if q_nope.shape[2] <= ABSORB_MAX_QUERIES:
            return self.output(self.unembed_out(self.latent_attention(self.embed_q(q_nope), q_pe, latent, k_pe, keep)))
        k = self.embed_q(latent, transpose=False)  # [B, heads, keys, nope]
        v = self.unembed_out(latent)  # [B, heads, keys, v]
        out = mx.fast.scaled_dot_product_attention(
            q_nope, k, v, scale=self.scale, mask=self.rope_scores(q_pe, k_pe, keep)
        )
        return self.output(out)


class LatentAttention(MLAttention):
    """MLA cut into the compiled decode step's pieces (``engine/decode/compiled_step.py``):
    ``qkv`` (the queries, moved into the latent space, and their rotated part, as a pair;
    the new latents; the new rope keys), ``attend`` over what the cache returns, and
    ``out``. Everything ``qkv`` does runs in the step's traced functions; what ``attend``
    does runs outside them, every op there launched on its own, so ``qkv`` leaves it no
    copies or elementwise work: the query parts stay apart (no concatenation to slice
    again) and any scaling of them happens inside.
    For a few rows the first query projection and ``kv_a_proj_with_mqa``, which read the
    same input, are one matmul (``models.stacked``).
    (DSA layers do not take this path: their attention also depends on other layers.)"""

    stacked_projections = (("q_proj", "kv_a_proj_with_mqa"), ("q_a_proj", "kv_a_proj_with_mqa"))
    # Decoding runs the compiled step. Measured on an H200 (MLX 0.32.4 CUDA, moonlight-16b-a3b
    # 4-bit, 512-token prompt): it once took 13.1 ms a token where the plain pass took 10.5,
    # so latent attention opted out (``compiled_decode = False``: the plain pass, with the
    # stacked projections below). Measured again after the step grew leaner (stacked
    # projections, the query parts as a pair): 6.5 ms against the plain pass's 7.9, and
    # whole decodes at 177.6 tok/s against 136.1 (mlx-lm 148.8 and 141.9 beside them).
    compiled_decode = True

    def input_projections(self, x: mx.array) -> tuple[mx.array | None, mx.array | None]:
        first = "q_proj" if self.q_lora_rank is None else "q_a_proj"
        q_in, kv = project(self, (first, "kv_a_proj_with_mqa"), x)  # one matmul for a few rows
        return q_in, kv

    def qkv(self, x: mx.array, offset) -> tuple[tuple[mx.array, mx.array], mx.array, mx.array]:
        q_in, kv = self.input_projections(x)
        q_nope, q_pe, _ = self.queries(x, offset, q_in)
        latent, k_pe = self.latents(x, offset, kv)
        # The fused call takes the RoPE scores ready-made, so they are scaled here, inside
        # the trace; the composed form scales them in its product for free. What the trace
        # did is remembered for ``attend``, which runs outside it.
        self.q_pe_scaled = not composed_latent_attention()
        return (self.embed_q(q_nope), q_pe * self.scale if self.q_pe_scaled else q_pe), latent, k_pe

    def attend(self, q: tuple[mx.array, mx.array], latent: mx.array, k_pe: mx.array, mask) -> mx.array:
        q_latent, q_pe = q
        keep = causal_keep(mask, q_latent.shape[2], latent.shape[2])
        return self.latent_attention(q_latent, q_pe, latent, k_pe, keep, scaled=getattr(self, "q_pe_scaled", False))

    def out(self, attn: mx.array) -> mx.array:
        return self.output(self.unembed_out(attn))


def split_kv_b(weights: dict[str, mx.array], prefix: str, args: Any) -> None:
    """Replace ``{prefix}.kv_b_proj`` by ``embed_q``/``unembed_out`` in place (HF
    checkpoints, and mlx-lm conversions made before mlx-lm split it, quantized or not)."""
    w = weights.pop(f"{prefix}.kv_b_proj.weight", None)
    if w is None:
        return
    scales = weights.pop(f"{prefix}.kv_b_proj.scales", None)
    biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
    bits = group_size = None
    if scales is not None:
        bits = w.shape[-1] * 32 // args.kv_lora_rank
        group_size = args.kv_lora_rank // scales.shape[-1]
        w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    w = w.reshape(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, -1)
    parts = {
        "embed_q": mx.contiguous(w[:, : args.qk_nope_head_dim, :].swapaxes(-1, -2)),
        "unembed_out": mx.contiguous(w[:, args.qk_nope_head_dim :, :]),
    }
    for name, value in parts.items():
        if scales is None:
            weights[f"{prefix}.{name}.weight"] = value
            continue
        q = mx.quantize(value, group_size, bits)
        weights[f"{prefix}.{name}.weight"], weights[f"{prefix}.{name}.scales"] = q[0], q[1]
        weights[f"{prefix}.{name}.biases"] = q[2]


def latent_caches(n_layers: int) -> list[MLALatentCache]:
    return [MLALatentCache() for _ in range(n_layers)]
