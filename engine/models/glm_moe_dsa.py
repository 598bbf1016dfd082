"""GLM-5 (``glm_moe_dsa``): DeepSeek V3's latent attention and routed experts, with
DeepSeek Sparse Attention (DSA): a light "indexer" scores every cached token for each
query and the attention only sees the ``index_topk`` best (all of them while there are
no more than that).

The indexer has its own queries (from the attention's query latent), one key per token
(cached beside the rope key, see ``mla_cache.py``), ReLU'd per-head scores and learned
per-head weights. Layers marked "shared" (``indexer_types``, or the pattern from
``index_topk_freq`` / ``index_skip_topk_offset`` / ``index_topk_pattern``) have no indexer
and reuse the selection of the last layer that has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models import deepseek_v3
from engine.models.base import attention_mask
from engine.models.mla import MLAttention, causal_keep
from engine.models.mla_cache import latent_bytes_per_token


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_routed_experts: int | None = 256
    q_lora_rank: int | None = 2048
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int | None = 1
    topk_group: int | None = 1
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: list[str] | None = None
    index_topk_pattern: str | list[str] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2

    def __post_init__(self):
        self.rope_interleave = True  # GLM-5 always pairs adjacent features
        if self.indexer_types is None:
            pattern = self.index_topk_pattern
            if isinstance(pattern, str):
                self.indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            elif pattern is not None:
                self.indexer_types = list(pattern)
            else:
                freq, offset = max(self.index_topk_freq or 1, 1), self.index_skip_topk_offset
                self.indexer_types = [
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(self.num_hidden_layers)
                ]

    def has_indexer(self, index: int) -> bool:
        return self.indexer_types[index] != "shared"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Latent + rope key in every layer, plus the indexer key where there is an indexer."""
        return sum(
            latent_bytes_per_token(
                self.kv_lora_rank, self.qk_rope_head_dim, dtype_bytes, self.index_head_dim if self.has_indexer(i) else 0
            )
            for i in range(self.num_hidden_layers)
        )


class Indexer(nn.Module):
    """HF's ``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm`` (a LayerNorm) and ``weights_proj``."""

    def __init__(self, args: ModelArgs, rope):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.rope = rope  # the attention's: the first qk_rope_head_dim features rotate

    def keys(self, x: mx.array, offset) -> mx.array:
        """The new tokens' indexer keys [B, 1, L, head_dim], as cached."""
        b, n, _ = x.shape
        return self.rope(self.k_norm(self.wk(x)).reshape(b, 1, n, self.head_dim), offset)

    def select(self, x: mx.array, q_resid: mx.array, offset, keys: mx.array, keep) -> mx.array:
        """Which keys each query attends to: booleans [B, 1, L, keys], ``topk`` per query."""
        b, n, _ = x.shape
        q = self.wq_b(q_resid).reshape(b, n, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(q, offset)
        scores = mx.maximum((q @ keys.swapaxes(-1, -2)) * self.head_dim**-0.5, 0)  # [B, heads, L, keys]
        weights = self.weights_proj(x) * self.n_heads**-0.5  # [B, L, heads]
        index_scores = (scores * weights.transpose(0, 2, 1)[..., None]).sum(axis=1)  # [B, L, keys]
        if keep is not None:
            index_scores = mx.where(keep, index_scores, mx.array(-mx.inf, index_scores.dtype))
        top = mx.argpartition(-index_scores, kth=self.topk - 1, axis=-1)[..., : self.topk]
        chosen = mx.put_along_axis(mx.zeros(index_scores.shape, mx.bool_), top, mx.array(True), axis=-1)
        return chosen[:, None]


class SparseAttention(MLAttention):
    """Latent attention restricted to the indexer's choice (its own, or the one handed in)."""

    def __init__(self, args: ModelArgs, with_indexer: bool):
        super().__init__(args)
        if with_indexer:
            self.indexer = Indexer(args, self.rope)

    def __call__(self, x: mx.array, mask, cache, chosen=None) -> tuple[mx.array, Any]:
        offset = cache.offset if cache is not None else 0
        q_nope, q_pe, q_resid = self.queries(x, offset)
        latent, k_pe = self.latents(x, offset)
        if "indexer" in self:
            k_pe = mx.concatenate([k_pe, self.indexer.keys(x, offset)], axis=-1)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        k_pe, index_keys = k_pe[..., : self.rope_dims], k_pe[..., self.rope_dims :]
        keep = causal_keep(mask, x.shape[1], latent.shape[2])
        if "indexer" in self:
            few = latent.shape[2] <= self.indexer.topk  # every key is chosen
            chosen = None if few else self.indexer.select(x, q_resid, offset, index_keys, keep)
        if chosen is not None:
            keep = chosen if keep is None else keep & chosen
        return self.attend_all(q_nope, q_pe, latent, k_pe, keep), chosen


class DecoderLayer(deepseek_v3.DecoderLayer):
    def make_attention(self, args: ModelArgs, index: int) -> nn.Module:
        return SparseAttention(args, args.has_indexer(index))

    def __call__(self, x: mx.array, mask, cache, chosen=None) -> tuple[mx.array, Any]:
        attn, chosen = self.self_attn(self.input_layernorm(x), mask, cache, chosen)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), chosen


class GlmMoeDsaModel(deepseek_v3.DeepseekV3Model):
    layer_class = DecoderLayer

    def run(self, inputs, cache, input_embeddings, make_mask=attention_mask, **_) -> mx.array:
        # Each layer hands its key selection to the next (shared layers reuse it).
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        cache = cache or [None] * len(self.layers)
        mask = make_mask(h.shape[1], cache[0], None)
        chosen = None
        for layer, c in zip(self.layers, cache):
            h, chosen = layer(h, mask, c, chosen)
        return self.norm(h)


class Model(deepseek_v3.Model):
    model_class = GlmMoeDsaModel


resident_weight = deepseek_v3.resident_weight  # its MTP layer loads as DeepSeek V3's does
held_in_float32 = deepseek_v3.held_in_float32
