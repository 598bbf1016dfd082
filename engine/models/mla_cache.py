"""The cache of multi-head latent attention (DeepSeek V3, Kimi K2, GLM-4.7 Flash, GLM-5).

MLA never needs per-head keys and values at decode time: queries are multiplied into
the latent space instead (the "absorbed" form), so a layer caches per token only

* the compressed latent (``kv_lora_rank`` values, after its RMSNorm), in ``keys``, and
* the rotated positional key shared by all heads (``qk_rope_head_dim`` values), in
  ``values``; layers with a DSA indexer append the indexer's own key
  (``index_head_dim`` values) to it.

Both are shaped [B, 1, tokens, dims], so the growing buffers, ``trim`` (prefix reuse,
speculative rewind), ``save``/``load`` and the memory figures are ``KVCache``'s own. For
DeepSeek V3 that is 576 values per token and layer, where expanded keys and values
would take 128 heads x 320 = 40,960.
"""

from __future__ import annotations

import mlx.core as mx

from engine.models.kv_cache import KVCache, register_cache_kind


@register_cache_kind
class MLALatentCache(KVCache):
    """``update_and_fetch(latent, rope_key)``: append the new tokens' latents and rope
    keys (plus indexer keys, when the layer has one); return everything cached."""

    def update_and_fetch(self, latent: mx.array, rope_key: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(latent, rope_key)


def latent_bytes_per_token(kv_lora_rank: int, rope_dims: int, dtype_bytes: int, index_dims: int = 0) -> int:
    """What one more token costs one MLA layer's cache."""
    return (kv_lora_rank + rope_dims + index_dims) * dtype_bytes
