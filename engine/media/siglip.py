"""SigLIP's vision transformer (the image tower of Gemma 3), as transformers builds it.

Patches are cut by a strided convolution, done here as one matmul over flattened
(C, p, p) patches; learned position embeddings are added; pre-norm encoder layers use
LayerNorm and a GELU(tanh) MLP; a final LayerNorm ends it. Weight names follow
``vision_model.*`` of transformers' SiglipVisionModel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.artifacts.config_fields import from_known_keys
from engine.models.base import activation


@dataclass
class SiglipVisionConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SiglipVisionConfig:
        return from_known_keys(cls, config)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class PatchEmbedding(nn.Module):
    """Conv2d(kernel = stride = patch) as a matmul; the weight keeps transformers' (O, C, p, p)."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        p, c = cfg.patch_size, cfg.num_channels
        self.patch, self.channels = p, c
        self.weight = mx.zeros((cfg.hidden_size, c, p, p))
        self.bias = mx.zeros((cfg.hidden_size,))

    def __call__(self, pixels: mx.array) -> mx.array:
        n, c, h, w = pixels.shape
        p = self.patch
        x = pixels.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = x.reshape(n, (h // p) * (w // p), c * p * p)
        return x @ self.weight.reshape(self.weight.shape[0], -1).T + self.bias


class Embeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = PatchEmbedding(cfg)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.patch_embedding(pixels) + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.scale = (d // self.heads) ** -0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def __call__(self, x: mx.array) -> mx.array:
        b, n, d = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class SiglipVisionTransformer(nn.Module):
    """pixel_values (N, C, H, W) -> last hidden state (N, patches, hidden)."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        x = self.embeddings(pixels.astype(self.embeddings.position_embedding.weight.dtype))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def sanitize(weights: dict[str, mx.array], cfg: SiglipVisionConfig) -> dict[str, mx.array]:
    """Drop the pooling head Gemma 3 never uses; bring an MLX-layout (O, p, p, C) patch
    kernel back to (O, C, p, p)."""
    out = {}
    for name, value in weights.items():
        if name.startswith("head.") or ".head." in name or "position_ids" in name:
            continue
        if name.endswith("patch_embedding.weight") and value.ndim == 4 and value.shape[1] != cfg.num_channels:
            value = value.transpose(0, 3, 1, 2)
        out[name] = value
    return out
