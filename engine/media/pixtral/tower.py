"""Mistral 3's Pixtral vision tower, its patch merger and projector, and its image encoder.

Pixtral: each p x p patch is embedded by one matmul (transformers' bias-free Conv2d) and
RMS-normalised; 2-D rotary embeddings rotate queries and keys by the patch's (row,
column) (the even frequencies by the row, the odd ones by the column); RMSNorm + gated-MLP
blocks attend over the whole image. Mistral 3's projector RMS-normalises the chosen
layer's output, joins each merge_size x merge_size block (channel-major, as
``torch.nn.functional.unfold`` lays it out), projects it back to the tower's width
(``patch_merger``), then Linear, GELU, Linear to the language model's.

In the prompt an image is rows of ``[IMG]`` tokens, each row ended by ``[IMG_BREAK]``
and the last by ``[IMG_END]``, as PixtralProcessor writes it; each row is one run of
soft tokens, and the encoder keeps the whole image's features for its rows. Weights:
``vision_tower.*`` / ``multi_modal_projector.*``, or under ``model.``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.api import MediaInput
from engine.artifacts.config_fields import from_known_keys
from engine.media.encoded_cache import media_key
from engine.media.image import load_image
from engine.media.pixtral.processor import PixtralImageProcessor
from engine.media.prompt import PreparedMedia
from engine.media.towers import LazyTowerEncoder, TowerSource, read_image_preprocessor
from engine.models.base import activation

IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
_RENAMES = (
    ("vision_tower.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


@dataclass
class VisionConfig:
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu"
    head_dim: int | None = None
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        config = dict(config)
        params = config.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" in params:
            config["rope_theta"] = params["rope_theta"]
        cfg = from_known_keys(cls, config)
        if cfg.head_dim is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        return cfg


class _Conv(nn.Module):
    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = mx.zeros(shape)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.scale = (d // self.heads) ** -0.5

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n, d = x.shape

        def heads(y: mx.array) -> mx.array:
            return y.reshape(n, self.heads, -1).transpose(1, 0, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(n, d))


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden_size, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=1e-5)
        self.attention = Attention(cfg)
        self.feed_forward = MLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class _Layers(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class PixtralVision(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        p = cfg.patch_size
        self.patch_conv = _Conv((cfg.hidden_size, cfg.num_channels, p, p))
        self.ln_pre = nn.RMSNorm(cfg.hidden_size, eps=1e-5)
        self.transformer = _Layers(cfg)
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        self._inv_rows, self._inv_cols = inv[0::2], inv[1::2]

    def __call__(self, pixels: mx.array) -> list[mx.array]:
        """(C, H, W) -> the input to the blocks and each block's output, (h*w, hidden) each."""
        c, height, width = pixels.shape
        p = self.config.patch_size
        h, w = height // p, width // p
        patches = pixels.reshape(c, h, p, w, p).transpose(1, 3, 0, 2, 4).reshape(h * w, c * p * p)
        weight = self.patch_conv.weight
        x = self.ln_pre(patches.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T)
        rows, cols = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
        angles = np.concatenate([rows.reshape(-1, 1) * self._inv_rows, cols.reshape(-1, 1) * self._inv_cols], axis=-1)
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = mx.array(np.cos(angles)).astype(x.dtype), mx.array(np.sin(angles)).astype(x.dtype)
        states = [x]
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
            states.append(x)
        return states


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def __call__(self, x: mx.array, h: int, w: int) -> mx.array:
        m, d = self.merge, x.shape[-1]
        # unfold's layout: channel-major, then the row and column inside the block.
        blocks = x.reshape(h // m, m, w // m, m, d).transpose(0, 2, 4, 1, 3)
        return self.merging_layer(blocks.reshape((h // m) * (w // m), d * m * m))


class Projector(nn.Module):
    def __init__(
        self, vision_hidden: int, text_hidden: int, merge: int, eps: float, act: str, bias: bool, layers: int = 1
    ):
        super().__init__()
        self.norm = nn.RMSNorm(vision_hidden, eps=eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden * layers, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def __call__(self, x: mx.array, h: int, w: int) -> mx.array:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), h, w))))


class Mistral3Vision(nn.Module):
    def __init__(
        self,
        cfg: VisionConfig,
        text_hidden: int,
        merge: int,
        eps: float,
        act: str,
        bias: bool,
        feature_layers: int | list[int],
    ):
        super().__init__()
        self.vision_tower = PixtralVision(cfg)
        self.feature_layers = feature_layers
        n = 1 if isinstance(feature_layers, int) else len(feature_layers)
        self.multi_modal_projector = Projector(cfg.hidden_size, text_hidden, merge, eps, act, bias, n)

    def __call__(self, pixels: mx.array) -> mx.array:
        states = self.vision_tower(pixels)
        layers = self.feature_layers
        x = states[layers] if isinstance(layers, int) else mx.concatenate([states[i] for i in layers], axis=-1)
        p = self.vision_tower.config.patch_size
        return self.multi_modal_projector(x, pixels.shape[1] // p, pixels.shape[2] // p)


class PixtralEncoder(LazyTowerEncoder):
    kind = "image"
    placeholder = IMG
    renames = _RENAMES
    what = "Pixtral vision tower"

    def __init__(self, source: TowerSource):
        raw = source.config.raw
        text = source.config.text
        self.source = source
        self.config = VisionConfig.from_dict(raw.get("vision_config") or {})
        self.merge = int(raw.get("spatial_merge_size", 2))
        self.text_hidden = int(text.get("hidden_size"))
        self.eps = float(text.get("rms_norm_eps", 1e-5))
        self.act = str(raw.get("projector_hidden_act", "gelu"))
        self.bias = bool(raw.get("multimodal_projector_bias", False))
        self.feature_layers = raw.get("vision_feature_layer", -1)
        self.token_id = int(raw.get("image_token_index", raw.get("image_token_id", 10)))
        self.processor = PixtralImageProcessor.from_config(
            read_image_preprocessor(source), self.config.patch_size, self.merge
        )
        self.module = None
        self.calls = 0
        self._last: tuple[str, mx.array] | None = None  # the last image's features, for its rows

    def prepare(self, item: MediaInput) -> PreparedMedia:
        pixels = self.processor(load_image(item.source))
        b = self.processor.block
        rows, cols = pixels.shape[1] // b, pixels.shape[2] // b
        key = media_key(item, {**self.processor.settings(), "model": str(self.source.path), "tower": "pixtral"})
        views = [
            PreparedMedia(kind="image", key=f"{key}:{r}", n_tokens=cols, text="", data=(key, pixels, r, cols))
            for r in range(rows)
        ]
        text = ((IMG * cols + IMG_BREAK) * rows)[: -len(IMG_BREAK)] + IMG_END
        return PreparedMedia(kind="image", key=key, n_tokens=rows * cols, text=text, data=None, views=views)

    def build(self) -> Mistral3Vision:
        return Mistral3Vision(
            self.config, self.text_hidden, self.merge, self.eps, self.act, self.bias, self.feature_layers
        )

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        dtype = getattr(mx, self.source.dtype, None)
        out = {}
        for name, value in weights.items():
            if name == "vision_tower.patch_conv.weight" and value.shape[1] != self.config.num_channels:
                value = value.transpose(0, 3, 1, 2)  # MLX layout (O, p, p, C) back to (O, C, p, p)
            if isinstance(dtype, mx.Dtype) and mx.issubdtype(value.dtype, mx.floating):
                value = value.astype(dtype)
            out[name] = value
        return out

    def run(self, module: Mistral3Vision, item: PreparedMedia) -> mx.array:
        key, pixels, row, cols = item.data
        if self._last is None or self._last[0] != key:
            features = module(mx.array(pixels))
            mx.eval(features)
            self._last = (key, features)
        return self._last[1][row * cols : (row + 1) * cols]


def make_encoder(source: TowerSource) -> PixtralEncoder:
    return PixtralEncoder(source)
