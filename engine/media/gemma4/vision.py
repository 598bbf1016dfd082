"""Gemma 4's vision tower, its projection into the language model, and its image encoder.

The tower reads the processor's patches (engine/media/gemma4/processor.py), maps pixels
from [0, 1] to [-1, 1], projects each patch and adds a learned embedding for its column
and one for its row. Its blocks are Gemma 4's: RMSNorm that scales by ``weight`` itself,
norms after attention and after the MLP too, queries and keys RMS-normalised per head
(values normalised without a scale), attention scores unscaled, grouped KV heads. The
2-D RoPE splits each head in two halves: the first rotates by the patch's column, the
second by its row, each half as an ordinary rotate-half RoPE of ``head_dim / 4``
frequencies. Every patch sees every other one (one image at a time, no padding here:
transformers pads to the budget and masks the padding out, which is the same thing).

Then the patch grid is average-pooled in k x k blocks (k = pooling_kernel_size), scaled
by sqrt(hidden) in float32, optionally standardised (stored bias and scale), and
``embed_vision`` RMS-normalises it (no scale) and projects it to the language model's
width: one soft token per block, row by row. Linear layers may carry clipping bounds
(``use_clipped_linears``), stored in the checkpoint as ``input_min``/``input_max``/
``output_min``/``output_max`` beside their ``linear``.

In the prompt the chat template's ``<|image|>`` becomes ``<|image>`` + one ``<|image|>``
per soft token + ``<image|>``, as Gemma4Processor writes it; on the sliding layers the
soft tokens of one image attend to each other both ways (engine/models/gemma4.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.api import MediaInput
from engine.artifacts.config_fields import from_known_keys
from engine.errors import UnsupportedModelError
from engine.media.encoded_cache import media_key
from engine.media.gemma4.processor import Gemma4ImageProcessor, VisionInput
from engine.media.image import load_image
from engine.media.prompt import PreparedMedia
from engine.media.towers import LazyTowerEncoder, TowerSource, read_image_preprocessor
from engine.models.base import activation

IMAGE, BOI, EOI = "<|image|>", "<|image>", "<image|>"
_RENAMES = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.embed_vision.", "embed_vision."),
    ("embed_vision.", "embed_vision."),
)


@dataclass
class VisionConfig:
    """transformers' Gemma4VisionConfig, with its defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "axial", "rope_theta": 100.0})

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        config = dict(config or {})
        if not isinstance(config.get("rope_parameters"), dict):  # a flat rope_theta, or none
            config["rope_parameters"] = {"rope_type": "axial", "rope_theta": float(config.get("rope_theta", 100.0))}
        cfg = from_known_keys(cls, config)
        if cfg.rope_parameters.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(
                f"Gemma 4's vision tower uses axial RoPE; this config asks for "
                f"{cfg.rope_parameters.get('rope_type')!r}."
            )
        return cfg

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 100.0))


class ClippableLinear(nn.Module):
    """A bias-free Linear whose input and output may be clamped to stored bounds."""

    def __init__(self, d_in: int, d_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = clipped
        if clipped:
            inf = float("inf")
            self.input_min, self.input_max = mx.array(-inf), mx.array(inf)
            self.output_min, self.output_max = mx.array(-inf), mx.array(inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """Gemma 4's RMSNorm in float32 (``weight`` scales as is; None: no scale)."""
    y = mx.fast.rms_norm(x.astype(mx.float32), None if weight is None else weight.astype(mx.float32), eps)
    return y.astype(x.dtype)


class Norm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_2d(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (n, heads, head_dim): the first half rotated by the columns' angles, the second by
    the rows' (cos/sin (n, 1, head_dim) laid out as [col, col, row, row])."""
    half = x.shape[-1] // 2
    parts = []
    for lo in (0, half):
        xs, c, s = x[..., lo : lo + half], cos[..., lo : lo + half], sin[..., lo : lo + half]
        parts.append(xs * c + _rotate_half(xs) * s)
    return mx.concatenate(parts, axis=-1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, hd, clip = cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears
        self.heads, self.kv_heads, self.head_dim, self.eps = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            cfg.rms_norm_eps,
        )
        self.q_proj = ClippableLinear(d, self.heads * hd, clip)
        self.k_proj = ClippableLinear(d, self.kv_heads * hd, clip)
        self.v_proj = ClippableLinear(d, self.kv_heads * hd, clip)
        self.o_proj = ClippableLinear(self.heads * hd, d, clip)
        self.q_norm = Norm(hd, cfg.rms_norm_eps)
        self.k_norm = Norm(hd, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n = x.shape[0]
        q = rope_2d(self.q_norm(self.q_proj(x).reshape(n, self.heads, -1)), cos, sin)
        k = rope_2d(self.k_norm(self.k_proj(x).reshape(n, self.kv_heads, -1)), cos, sin)
        v = rms_norm(self.v_proj(x).reshape(n, self.kv_heads, -1), None, self.eps)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, inner, clip = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(d, inner, clip)
        self.up_proj = ClippableLinear(d, inner, clip)
        self.down_proj = ClippableLinear(inner, d, clip)
        self.act = activation(cfg.hidden_activation)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = Norm(d, eps)
        self.post_attention_layernorm = Norm(d, eps)
        self.pre_feedforward_layernorm = Norm(d, eps)
        self.post_feedforward_layernorm = Norm(d, eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size, cfg.hidden_size))

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        w = self.input_proj.weight
        x = self.input_proj((2 * (patches - 0.5)).astype(w.dtype))
        table = self.position_embedding_table
        return x + (table[0][positions[:, 0]] + table[1][positions[:, 1]]).astype(x.dtype)


class VisionTower(nn.Module):
    """transformers' Gemma4VisionModel for one image's real patches."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))
        quarter = cfg.head_dim // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def rope(self, positions: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        freqs = positions[:, :, None].astype(np.float32) * self._inv_freq  # (n, 2, head_dim / 4)
        col, row = freqs[:, 0], freqs[:, 1]
        angles = np.concatenate([col, col, row, row], axis=-1)[:, None, :]
        return mx.array(np.cos(angles)).astype(dtype), mx.array(np.sin(angles)).astype(dtype)

    def __call__(self, patches: np.ndarray, positions: np.ndarray) -> mx.array:
        """(n, 3 p p) patches and their (column, row) -> (n / k^2, hidden) float32 soft tokens."""
        cfg = self.config
        x = self.patch_embedder(mx.array(patches), mx.array(positions))
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = cfg.pooling_kernel_size
        cols, rows = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
        d = x.shape[-1]
        # Patches come row by row, so each k x k block is a reshape away; the mean is transformers' sum / k^2.
        grid = x.astype(mx.float32).reshape(rows // k, k, cols // k, k, d)
        pooled = grid.sum(axis=(1, 3)).reshape(-1, d) / (k * k)
        pooled = pooled * (cfg.hidden_size**0.5)
        if cfg.standardize:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled


class Embedder(nn.Module):
    """embed_vision / embed_audio: RMSNorm without a scale, then a projection."""

    def __init__(self, d_in: int, d_text: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(d_in, d_text, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(rms_norm(x, None, self.eps))


class Gemma4Vision(nn.Module):
    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = Embedder(cfg.hidden_size, text_hidden, cfg.rms_norm_eps)

    def __call__(self, item: VisionInput) -> mx.array:
        dtype = self.embed_vision.embedding_projection.weight.dtype
        return self.embed_vision(self.vision_tower(item.patches, item.positions).astype(dtype))


def sanitize(weights: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Tower weights in the language model's dtype (clipping bounds kept as they are)."""
    target = getattr(mx, dtype, None)
    out = {}
    for name, value in weights.items():
        if (
            isinstance(target, mx.Dtype)
            and mx.issubdtype(value.dtype, mx.floating)
            and not name.endswith(("_min", "_max"))
        ):
            value = value.astype(target)
        out[name] = value
    return out


class Gemma4VisionEncoder(LazyTowerEncoder):
    kind = "image"
    placeholder = IMAGE
    renames = _RENAMES
    what = "Gemma 4 vision tower"

    def __init__(self, source: TowerSource):
        raw = source.config.raw
        self.source = source
        self.config = VisionConfig.from_dict(raw.get("vision_config") or {})
        self.token_id = int(raw.get("image_token_id", raw.get("image_token_index", 258_880)))
        self.text_hidden = int(source.config.text.get("hidden_size") or raw.get("hidden_size"))
        pre = read_image_preprocessor(source)
        pre = {"patch_size": self.config.patch_size, "pooling_kernel_size": self.config.pooling_kernel_size, **pre}
        self.processor = Gemma4ImageProcessor.from_config(pre)
        if (
            self.processor.pooling_kernel_size != self.config.pooling_kernel_size
            or self.processor.patch_size != self.config.patch_size
        ):
            raise UnsupportedModelError(
                f"{source.name}: the image processor's patch or pooling size does not "
                "match the vision tower's; download the model's configs again."
            )
        self.module: Gemma4Vision | None = None
        self.calls = 0

    def prepare(self, item: MediaInput) -> PreparedMedia:
        vision = self.processor(load_image(item.source))
        n = vision.soft_tokens
        key = media_key(item, {**self.processor.settings(), "model": str(self.source.path), "tower": "gemma4"})
        return PreparedMedia(kind="image", key=key, n_tokens=n, text=f"{BOI}{IMAGE * n}{EOI}", data=vision)

    def build(self) -> Gemma4Vision:
        return Gemma4Vision(self.config, self.text_hidden)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return sanitize(weights, self.source.dtype)

    def run(self, module: Gemma4Vision, item: PreparedMedia) -> mx.array:
        return module(item.data)


def make_encoder(source: TowerSource) -> Gemma4VisionEncoder:
    return Gemma4VisionEncoder(source)
