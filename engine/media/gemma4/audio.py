"""Gemma 4's ears: the Conformer audio tower (transformers' Gemma4AudioModel) and its encoder.

The processor's log-mel frames (engine/media/gemma4/processor.py) go through two 3 x 3
stride-2 convolutions over (time, mel), each followed by a bias-free LayerNorm over the
channels and ReLU (frames outside the clip are zeroed before each), then one projection
of every time step's (mel, channel) values to the tower's width: one step per 4 frames.

Each Conformer block: a half-step feed-forward, chunked local self-attention, a light
convolution (GLU, causal depthwise conv, RMSNorm, activation), a second half-step
feed-forward, a final RMSNorm; activations are clamped to +-``gradient_clipping`` at the
points transformers clamps them. The attention cuts the sequence into blocks of
``attention_chunk_size`` queries; each block sees keys from ``attention_context_left - 1``
steps back to ``attention_context_right`` ahead (less one at each end: transformers'
mask has exclusive bounds). Queries are scaled per dimension
(softplus of a learned vector) and keys by a constant, a Transformer-XL relative
position term (sinusoids through ``relative_k_proj``, "rel-shifted") is added, the sum is
soft-capped with tanh, and steps outside the window or the clip are masked. This is
ported as transformers computes it, block layout included, so the numbers agree.

``output_proj`` maps to ``output_proj_dims``; ``embed_audio`` RMS-normalises (no scale)
and projects to the language model's width. Only the clip's valid steps become soft
tokens: ``<|audio>`` + one ``<|audio|>`` each + ``<audio|>`` in the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts.config_fields import from_known_keys
from engine.errors import UnsupportedModelError
from engine.media.gemma4.processor import Gemma4AudioFeatures, audio_soft_tokens
from engine.media.gemma4.vision import ClippableLinear, Embedder, Norm, sanitize
from engine.media.towers import LazyTowerEncoder, TowerSource, read_nested_preprocessor
from engine.models.base import activation

AUDIO, BOA, EOA = "<|audio|>", "<|audio>", "<audio|>"
_RENAMES = (
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.embed_audio.", "embed_audio."),
    ("embed_audio.", "embed_audio."),
)


@dataclass
class AudioConfig:
    """transformers' Gemma4AudioConfig, with its defaults."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: list[int] = field(default_factory=lambda: [128, 32])
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AudioConfig:
        cfg = from_known_keys(cls, dict(config or {}))
        if len(cfg.subsampling_conv_channels) != 2:
            raise UnsupportedModelError("Gemma 4's audio tower needs two subsampling_conv_channels in audio_config.")
        return cfg

    @property
    def context_size(self) -> int:
        return self.attention_chunk_size + self.attention_context_left - 1 + self.attention_context_right


def _clamp(x: mx.array, limit: float) -> mx.array:
    limit = min(limit, float(np.finfo(np.float16).max) if x.dtype == mx.float16 else limit)
    return mx.clip(x, -limit, limit)


class LayerNormNoBias(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, self.weight, None, self.eps)


class _Conv2d(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.weight = mx.zeros((c_out, 3, 3, c_in))  # MLX layout: (out, kh, kw, in)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.conv2d(x, self.weight, stride=2, padding=1)


class SubsampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.conv = _Conv2d(c_in, c_out)
        self.norm = LayerNormNoBias(c_out, eps)

    def __call__(self, x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        """x (1, time, mel, channels), mask (time,) -> halved in time and mel."""
        x = x * mask[None, :, None, None].astype(x.dtype)
        x = nn.relu(self.norm(self.conv(x.astype(self.conv.weight.dtype))))
        return x, mask[::2]


class SubsampleProjection(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, cfg.hidden_size, bias=False)

    def __call__(self, features: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x, mask = self.layer0(features[None, :, :, None], mask)
        x, mask = self.layer1(x, mask)
        _, t, f, c = x.shape
        return self.input_proj_linear(x.reshape(1, t, f * c)), mask


class FeedForward(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(d, 4 * d, clip)
        self.ffw_layer_2 = ClippableLinear(4 * d, d, clip)
        self.pre_layer_norm = Norm(d, 1e-6)  # transformers leaves these at their default eps
        self.post_layer_norm = Norm(d, 1e-6)
        self.act = activation(cfg.hidden_act)
        self.clip, self.scale = cfg.gradient_clipping, cfg.residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_layer_norm(_clamp(x, self.clip))
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(_clamp(h, self.clip)) * self.scale


class Attention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.heads = cfg.num_attention_heads
        self.head_dim = d // self.heads
        self.chunk = cfg.attention_chunk_size
        self.past = cfg.attention_context_left - 1
        self.future = cfg.attention_context_right
        self.context = cfg.context_size
        self.cap = cfg.attention_logit_cap
        self.invalid = cfg.attention_invalid_logits_value
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.q_proj = ClippableLinear(d, d, clip)
        self.k_proj = ClippableLinear(d, d, clip)
        self.v_proj = ClippableLinear(d, d, clip)
        self.post = ClippableLinear(d, d, clip)
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))

    def _blocks(self, x: mx.array, blocks: int) -> mx.array:
        """(T, H, D) -> (blocks, chunk, H, D), zero-padded at the end."""
        pad = blocks * self.chunk - x.shape[0]
        return mx.pad(x, [(0, pad), (0, 0), (0, 0)]).reshape(blocks, self.chunk, *x.shape[1:])

    def _context(self, x: mx.array, blocks: int) -> mx.array:
        """(T, H, D) -> (blocks, context, H, D): each block's overlapping window of keys."""
        x = mx.pad(x, [(self.past, self.future + self.chunk - 1), (0, 0), (0, 0)])
        index = (np.arange(blocks)[:, None] * self.chunk + np.arange(self.context)[None, :]).reshape(-1)
        return x[mx.array(index)].reshape(blocks, self.context, *x.shape[1:])

    def _rel_shift(self, x: mx.array) -> mx.array:
        """(H, blocks, chunk, P) -> (H, blocks, chunk, context), Transformer-XL's shift."""
        h, b, c, p = x.shape
        x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, self.context + 1 - p)])
        x = x.reshape(h, b, c * (self.context + 1))[..., : c * self.context]
        return x.reshape(h, b, c, self.context)

    def __call__(self, x: mx.array, rel: mx.array, mask: mx.array) -> mx.array:
        """x (T, d), rel (P, d) sinusoids, mask (blocks, chunk, context) True where allowed."""
        t = x.shape[0]
        shape = (t, self.heads, self.head_dim)
        q = self.q_proj(x).astype(mx.float32).reshape(shape)
        k = self.k_proj(x).astype(mx.float32).reshape(shape)
        v = self.v_proj(x).astype(mx.float32).reshape(shape)
        q = q * self.q_scale * nn.softplus(self.per_dim_scale.astype(mx.float32))
        k = k * self.k_scale
        blocks = -(-t // self.chunk)
        q, k, v = self._blocks(q, blocks), self._context(k, blocks), self._context(v, blocks)
        rel_k = self.relative_k_proj(rel).reshape(-1, self.heads, self.head_dim).astype(mx.float32)
        queries = q.transpose(2, 0, 1, 3)  # (H, blocks, chunk, D)
        ac = queries @ k.transpose(2, 0, 3, 1)  # (H, blocks, chunk, context)
        bd = queries.reshape(self.heads, -1, self.head_dim) @ rel_k.transpose(1, 2, 0)
        bd = self._rel_shift(bd.reshape(self.heads, blocks, self.chunk, -1))
        scores = mx.tanh((ac + bd) / self.cap) * self.cap
        scores = mx.where(mask[None], scores, self.invalid)
        weights = mx.softmax(scores, axis=-1, precise=True)
        out = weights @ v.transpose(2, 0, 1, 3)  # (H, blocks, chunk, D)
        out = out.transpose(1, 2, 0, 3).reshape(blocks * self.chunk, -1)[:t]
        return self.post(out.astype(x.dtype))


class CausalDepthwiseConv(nn.Module):
    def __init__(self, dims: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((dims, kernel, 1))  # MLX layout: (out, k, in / groups)
        self.kernel = kernel

    def __call__(self, x: mx.array) -> mx.array:
        """x (1, T, d): each step sees itself and the kernel - 1 before it."""
        x = mx.pad(x, [(0, 0), (self.kernel - 1, 0), (0, 0)])
        return mx.conv1d(x, self.weight, groups=x.shape[-1])


class LightConv(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.linear_start = ClippableLinear(d, 2 * d, clip)
        self.linear_end = ClippableLinear(d, d, clip)
        self.depthwise_conv1d = CausalDepthwiseConv(d, cfg.conv_kernel_size)
        self.pre_layer_norm = Norm(d, cfg.rms_norm_eps)
        self.conv_norm = Norm(d, cfg.rms_norm_eps)
        self.act = activation(cfg.hidden_act)
        self.clip = cfg.gradient_clipping

    def __call__(self, x: mx.array) -> mx.array:
        h = self.linear_start(self.pre_layer_norm(x))
        a, g = mx.split(h, 2, axis=-1)
        h = self.depthwise_conv1d((a * mx.sigmoid(g))[None])[0]
        h = self.act(self.conv_norm(_clamp(h, self.clip)))
        return x + self.linear_end(h)


class ConformerLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.self_attn = Attention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn = Norm(d, 1e-6)
        self.norm_post_attn = Norm(d, 1e-6)
        self.norm_out = Norm(d, 1e-6)
        self.clip = cfg.gradient_clipping

    def __call__(self, x: mx.array, rel: mx.array, mask: mx.array) -> mx.array:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), rel, mask)
        x = x + self.norm_post_attn(_clamp(h, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clamp(x, self.clip))


class AudioTower(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.config = cfg
        self.subsample_conv_projection = SubsampleProjection(cfg)
        self.layers = [ConformerLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def relative_positions(self) -> np.ndarray:
        """Sinusoids for distances context // 2 down to 0, [sin..., cos...]."""
        cfg = self.config
        n = cfg.hidden_size // 2
        inv = np.exp(np.arange(n, dtype=np.float32) * -(math.log(10000.0) / max(n - 1, 1))).astype(np.float32)
        pos = np.arange(cfg.context_size // 2, -1, -1, dtype=np.float32)[:, None] * inv[None, :]
        return np.concatenate([np.sin(pos), np.cos(pos)], axis=-1)

    def attention_mask(self, valid: np.ndarray) -> np.ndarray:
        """(blocks, chunk, context) True where a query may see a key: the key is in the clip
        and within the window (transformers' 4-D mask cut into its block layout)."""
        cfg = self.config
        t, c = valid.shape[0], cfg.attention_chunk_size
        past, future = cfg.attention_context_left - 1, cfg.attention_context_right
        q, k = np.arange(t)[:, None], np.arange(t)[None, :]
        dist = q - k
        # transformers' sliding_window_mask_function((past, future)): the bounds are exclusive,
        # so a query sees past - 1 steps back and future - 1 ahead (the block layout spans more).
        allowed = (((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < future))) & valid[None, :]
        blocks = -(-t // c)
        full = np.zeros((blocks * c, blocks * c + past + future), dtype=bool)
        full[:t, past : past + t] = allowed
        full = full.reshape(blocks, c, -1)
        index = np.arange(blocks)[:, None] * c + np.arange(cfg.context_size)[None, :]
        return np.take_along_axis(full, index[:, None, :].repeat(c, axis=1), axis=-1)

    def __call__(self, features: np.ndarray, mask: np.ndarray) -> tuple[mx.array, np.ndarray]:
        """(frames, mels) features and their valid-frame mask -> (steps, output_proj_dims) and
        the steps' mask."""
        x, _ = self.subsample_conv_projection(mx.array(features), mx.array(mask))
        valid = np.asarray(mask)
        for _ in range(2):
            valid = valid[::2]
        x = x[0]
        rel = mx.array(self.relative_positions()).astype(x.dtype)
        allowed = mx.array(self.attention_mask(valid))
        for layer in self.layers:
            x = layer(x, rel, allowed)
        return self.output_proj(x), valid


class Gemma4Audio(nn.Module):
    def __init__(self, cfg: AudioConfig, text_hidden: int):
        super().__init__()
        self.audio_tower = AudioTower(cfg)
        self.embed_audio = Embedder(cfg.output_proj_dims, text_hidden, cfg.rms_norm_eps)

    def __call__(self, features: np.ndarray, mask: np.ndarray) -> mx.array:
        out, valid = self.audio_tower(features, mask)
        return self.embed_audio(out)[mx.array(np.flatnonzero(valid))]


def sanitize_audio(weights: dict[str, Any], cfg: AudioConfig, dtype: str) -> dict[str, Any]:
    """Conv kernels from PyTorch's layout to MLX's, unless a conversion stored them so already."""
    out = {}
    for name, value in sanitize(weights, dtype).items():
        if name.endswith("conv.weight") and value.ndim == 4 and value.shape[-1] == 3 and value.shape[1] != 3:
            value = value.transpose(0, 2, 3, 1)  # (out, in, kh, kw) -> (out, kh, kw, in)
        elif (
            name.endswith("depthwise_conv1d.weight")
            and value.ndim == 3
            and value.shape[1] == 1
            and cfg.conv_kernel_size != 1
        ):
            value = value.transpose(0, 2, 1)  # (out, 1, k) -> (out, k, 1)
        out[name] = value
    return out


class Gemma4AudioEncoder(LazyTowerEncoder):
    kind = "audio"
    placeholder = AUDIO
    renames = _RENAMES
    what = "Gemma 4 audio tower"

    def __init__(self, source: TowerSource):
        raw = source.config.raw
        self.source = source
        self.config = AudioConfig.from_dict(raw.get("audio_config") or {})
        self.token_id = int(raw.get("audio_token_id", 258_881))
        self.text_hidden = int(source.config.text.get("hidden_size") or raw.get("hidden_size"))
        self.features = Gemma4AudioFeatures.from_config(read_nested_preprocessor(source, "feature_extractor"))
        self.module: Gemma4Audio | None = None
        self.calls = 0

    def prepare(self, item: Any) -> Any:
        from engine.media.audio import load_audio_source
        from engine.media.encoded_cache import media_key
        from engine.media.prompt import PreparedMedia

        samples = load_audio_source(item.source, self.features.sampling_rate)
        feats, mask = self.features(samples)
        n = audio_soft_tokens(mask)
        key = media_key(item, {**self.features.settings(), "model": str(self.source.path), "tower": "gemma4"})
        return PreparedMedia(
            kind="audio",
            key=key,
            n_tokens=n,
            text=f"{BOA}{AUDIO * n}{EOA}",
            data=(feats, mask),
            note=self.features.cut_note(len(samples)),
        )

    def build(self) -> Gemma4Audio:
        return Gemma4Audio(self.config, self.text_hidden)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return sanitize_audio(weights, self.config, self.source.dtype)

    def run(self, module: Gemma4Audio, item: Any) -> mx.array:
        return module(*item.data)


def make_encoder(source: TowerSource) -> Gemma4AudioEncoder:
    return Gemma4AudioEncoder(source)
