"""Whisper (encoder-decoder speech recogniser) in MLX, reading Hugging Face weights.

Parameter names follow transformers' WhisperForConditionalGeneration with the leading
``model.`` removed, so a checkpoint's safetensors load after ``sanitize``. The encoder
also serves Whisper-style audio towers. The decoder keeps a per-layer cache: its own
keys/values grow by one step per token; the cross-attention keys/values are computed
from the encoder output once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts.config_fields import from_known_keys
from engine.errors import ModelLoadError, UnsupportedModelError

_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which Whisper uses


_CONV_KERNELS = ("encoder.conv1.weight", "encoder.conv2.weight")
# Audio-language checkpoints (Qwen2-Audio, Voxtral) name their Whisper-style tower and its
# projector so; first match wins.
AUDIO_TOWER_RENAMES = (
    ("model.audio_tower.", "encoder."),
    ("audio_tower.", "encoder."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)


def conv_kernel(name: str, value: Any, d_model: int, n_mels: int) -> Any:
    """A Whisper-style encoder's conv kernel (Hugging Face layout [out, in, 3]) in MLX's
    channels-last layout; one a conversion already stored channels-last passes as it is.
    Every other tensor passes unchanged. Serves Whisper, Qwen2-Audio and Voxtral."""
    if name not in _CONV_KERNELS:
        return value
    c_in = n_mels if name == _CONV_KERNELS[0] else d_model
    shape = tuple(value.shape)
    if shape == (d_model, c_in, 3):
        return mx.array(value).transpose(0, 2, 1)
    if shape != (d_model, 3, c_in):
        raise ModelLoadError(f"{name} has shape {shape}, expected {(d_model, c_in, 3)}; check the model's config.")
    return value


@dataclass
class WhisperConfig:
    vocab_size: int = 51865
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_attention_heads: int = 6
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_target_positions: int = 448
    scale_embedding: bool = False
    activation_function: str = "gelu"
    tie_word_embeddings: bool = True
    decoder_start_token_id: int = 50258
    eos_token_id: int = 50257

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> WhisperConfig:
        cfg = from_known_keys(cls, config)
        if cfg.activation_function not in ("gelu",):
            raise UnsupportedModelError(
                f"Whisper activation {cfg.activation_function!r} is not supported (only 'gelu')."
            )
        return cfg


class WhisperAttention(nn.Module):
    """Multi-head attention; ``k_proj`` has no bias in Whisper."""

    def __init__(self, dims: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dims // heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims)
        self.out_proj = nn.Linear(dims, dims)

    def _split(self, x: mx.array) -> mx.array:
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)

    def keys_values(self, source: mx.array) -> tuple[mx.array, mx.array]:
        return self._split(self.k_proj(source)), self._split(self.v_proj(source))

    def __call__(
        self,
        x: mx.array,
        keys_values: tuple[mx.array, mx.array] | None = None,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """``keys_values`` defaults to projections of ``x`` (plain self-attention)."""
        q = self._split(self.q_proj(x))
        k, v = keys_values if keys_values is not None else self.keys_values(x)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, dims: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(dims, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dims, eps=_LAYER_NORM_EPS)
        self.fc1 = nn.Linear(dims, ffn)
        self.fc2 = nn.Linear(ffn, dims)
        self.final_layer_norm = nn.LayerNorm(dims, eps=_LAYER_NORM_EPS)

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        """``mask``: additive, broadcast over heads and queries (padding keys at -inf)."""
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask=mask)
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = [
            EncoderLayer(d, cfg.encoder_attention_heads, cfg.encoder_ffn_dim) for _ in range(cfg.encoder_layers)
        ]
        self.layer_norm = nn.LayerNorm(d, eps=_LAYER_NORM_EPS)

    def __call__(self, features: mx.array) -> mx.array:
        """(batch, n_mels, frames) log-mel features -> (batch, frames // 2, d_model)."""
        x = features.transpose(0, 2, 1)  # MLX convolutions are channels-last
        x = nn.gelu(self.conv1(x))
        x = nn.gelu(self.conv2(x))
        n = x.shape[1]
        if n > self.embed_positions.weight.shape[0]:
            raise ValueError(f"{2 * n} feature frames exceed this encoder's {2 * self.embed_positions.weight.shape[0]}")
        x = x + self.embed_positions.weight[:n]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


@dataclass
class DecoderLayerCache:
    """Self-attention keys/values so far, and the fixed cross-attention ones."""

    self_kv: tuple[mx.array, mx.array] | None = None
    cross_kv: tuple[mx.array, mx.array] | None = None


class DecoderLayer(nn.Module):
    def __init__(self, dims: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(dims, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dims, eps=_LAYER_NORM_EPS)
        self.encoder_attn = WhisperAttention(dims, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dims, eps=_LAYER_NORM_EPS)
        self.fc1 = nn.Linear(dims, ffn)
        self.fc2 = nn.Linear(ffn, dims)
        self.final_layer_norm = nn.LayerNorm(dims, eps=_LAYER_NORM_EPS)

    def __call__(self, x: mx.array, encoded: mx.array, cache: DecoderLayerCache) -> mx.array:
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.keys_values(h)
        if cache.self_kv is not None:
            k = mx.concatenate([cache.self_kv[0], k], axis=2)
            v = mx.concatenate([cache.self_kv[1], v], axis=2)
        cache.self_kv = (k, v)
        # New queries sit at the end of the sequence: causal mask aligned bottom-right.
        mask = "causal" if x.shape[1] > 1 else None
        x = x + self.self_attn(h, (k, v), mask=mask)
        if cache.cross_kv is None:
            cache.cross_kv = self.encoder_attn.keys_values(encoded)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), cache.cross_kv)
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed_scale = d**0.5 if cfg.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, d)
        self.layers = [
            DecoderLayer(d, cfg.decoder_attention_heads, cfg.decoder_ffn_dim) for _ in range(cfg.decoder_layers)
        ]
        self.layer_norm = nn.LayerNorm(d, eps=_LAYER_NORM_EPS)

    def __call__(self, ids: mx.array, encoded: mx.array, cache: list[DecoderLayerCache]) -> mx.array:
        """(batch, new tokens) -> hidden states (batch, new tokens, d_model); ``cache`` advances."""
        offset = 0 if cache[0].self_kv is None else cache[0].self_kv[0].shape[2]
        n = ids.shape[1]
        if offset + n > self.embed_positions.weight.shape[0]:
            raise ValueError(f"Whisper's decoder holds at most {self.embed_positions.weight.shape[0]} tokens")
        x = self.embed_tokens(ids) * self.embed_scale + self.embed_positions.weight[offset : offset + n]
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, encoded, layer_cache)
        return self.layer_norm(x)


class Whisper(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)
        if not cfg.tie_word_embeddings:
            self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def make_cache(self) -> list[DecoderLayerCache]:
        return [DecoderLayerCache() for _ in self.decoder.layers]

    def encode(self, features: mx.array | np.ndarray) -> mx.array:
        features = mx.array(features)
        if features.ndim == 2:
            features = features[None]
        return self.encoder(features)

    def logits(self, ids: mx.array, encoded: mx.array, cache: list[DecoderLayerCache]) -> mx.array:
        h = self.decoder(ids, encoded, cache)
        if self.config.tie_word_embeddings:
            return self.decoder.embed_tokens.as_linear(h)
        return self.proj_out(h)

    def greedy_decode(
        self,
        features: mx.array | np.ndarray,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """Argmax decoding of one clip after ``prompt_ids`` (e.g. start, language, task tokens).

        Returns only the new ids; stops after ``eos_token_id`` (included) when given.
        """
        return self.decode_greedy(self.encode(features), prompt_ids, max_new_tokens, eos_token_id)

    def decode_greedy(
        self,
        encoded: mx.array,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """``greedy_decode`` on an encoder output (encode once, decode several prompts)."""
        cache = self.make_cache()
        ids = mx.array([list(prompt_ids)], dtype=mx.int32)
        out: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(mx.argmax(self.logits(ids, encoded, cache)[0, -1]).item())
            out.append(next_id)
            if next_id == eos_token_id:
                break
            ids = mx.array([[next_id]], dtype=mx.int32)
        return out

    def sanitize(self, weights: Mapping[str, Any]) -> dict[str, mx.array]:
        """Hugging Face names and layouts -> this module's (conv kernels to channels-last)."""
        cfg = self.config
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            if name == "proj_out.weight" and cfg.tie_word_embeddings:
                continue  # tied to decoder.embed_tokens
            out[name] = mx.array(conv_kernel(name, value, cfg.d_model, cfg.num_mel_bins))
        return out

    def load_hf_weights(self, weights: Mapping[str, Any]) -> None:
        """Load a full set of transformers-named weights; missing or extra names are errors."""
        try:
            self.load_weights(list(self.sanitize(weights).items()), strict=True)
        except ValueError as e:
            raise ModelLoadError(f"Whisper weights do not fit the config: {e}") from None
        mx.eval(self.parameters())
