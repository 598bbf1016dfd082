"""Voxtral's ears: a Whisper encoder per 30 s chunk, frames grouped four by four and
projected into the language model.

As transformers' VoxtralProcessor (through mistral-common) prepares audio, a clip is
zero-padded to a whole number of 30 s chunks, its 128-bin log-mel features are computed
over the whole padded clip (one dynamic range), and cut into chunks of 3000 frames. Each
chunk runs through the encoder unmasked (padding included, as the model was trained);
its 1500 positions are then regrouped into rows of ``intermediate_size`` values (four
consecutive positions for the real 1280/5120 encoder), and a two-layer GELU projector
maps each row to the language model's width: 375 [AUDIO] tokens per chunk, whatever
part of it holds sound.

Weight names follow the Hub checkpoints (``audio_tower.*``, ``multi_modal_projector.*``)
or transformers 5's spelling under ``model.``; the tower loads from the model folder on
the first audio request, so text-only chats never pay for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts.config_fields import from_known_keys
from engine.errors import MediaError, UnsupportedModelError
from engine.media.mel import WHISPER_CHUNK_SECONDS, WHISPER_SAMPLE_RATE, log_mel_spectrogram
from engine.media.towers import LazyTowerEncoder, TowerSource
from engine.media.whisper.model import AUDIO_TOWER_RENAMES, WhisperConfig, WhisperEncoder, conv_kernel

CHUNK_SAMPLES = WHISPER_CHUNK_SECONDS * WHISPER_SAMPLE_RATE
# Voxtral's stated limit for audio understanding; longer clips would not fit its context.
MAX_SECONDS = 40 * 60
AUDIO_PAD = "[AUDIO]"
# transformers' VoxtralEncoderConfig maps Whisper's names onto these.
_ALIASES = {
    "d_model": "hidden_size",
    "encoder_layers": "num_hidden_layers",
    "encoder_attention_heads": "num_attention_heads",
    "encoder_ffn_dim": "intermediate_size",
}


@dataclass
class VoxtralEncoderConfig:
    """transformers' VoxtralEncoderConfig, with its defaults (Voxtral-Mini-3B's encoder)."""

    num_mel_bins: int = 128
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 20
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None) -> VoxtralEncoderConfig:
        config = dict(config or {})
        for old, new in _ALIASES.items():
            if old in config and new not in config:
                config[new] = config[old]
        cfg = from_known_keys(cls, config)
        if (cfg.max_source_positions * cfg.hidden_size) % cfg.intermediate_size:
            raise UnsupportedModelError(
                f"Voxtral's audio encoder cannot group {cfg.max_source_positions} positions of width "
                f"{cfg.hidden_size} into rows of {cfg.intermediate_size}; check audio_config in config.json."
            )
        return cfg

    @property
    def chunk_frames(self) -> int:
        return 2 * self.max_source_positions  # the stride-2 convolution halves them

    @property
    def tokens_per_chunk(self) -> int:
        return self.max_source_positions * self.hidden_size // self.intermediate_size

    def whisper(self) -> WhisperConfig:
        # The same encoder as Whisper's, with no decoder behind it.
        return WhisperConfig.from_dict(
            {
                "num_mel_bins": self.num_mel_bins,
                "d_model": self.hidden_size,
                "encoder_layers": self.num_hidden_layers,
                "encoder_attention_heads": self.num_attention_heads,
                "encoder_ffn_dim": self.intermediate_size,
                "max_source_positions": self.max_source_positions,
                "activation_function": self.activation_function,
                "decoder_layers": 0,
                "vocab_size": 1,
            }
        )


def chunk_count(n_samples: int) -> int:
    return -(-n_samples // CHUNK_SAMPLES)


def clip_features(samples: np.ndarray, cfg: VoxtralEncoderConfig) -> np.ndarray:
    """16 kHz mono samples -> log-mel features (chunks, n_mels, 3000). Needs no weights, so a
    prompt can be laid out before the tower is loaded."""
    n = samples.shape[0]
    if n == 0:
        raise MediaError("The audio clip is empty.")
    if n > MAX_SECONDS * WHISPER_SAMPLE_RATE:
        raise MediaError(
            f"The audio clip lasts {n / WHISPER_SAMPLE_RATE / 60:.0f} minutes; Voxtral hears at most "
            f"{MAX_SECONDS // 60}. Cut it, or transcribe it first."
        )
    chunks = chunk_count(n)
    padded = np.pad(np.asarray(samples, dtype=np.float32), (0, chunks * CHUNK_SAMPLES - n))
    feats = log_mel_spectrogram(padded, n_mels=cfg.num_mel_bins, chunk_seconds=None)
    if feats.shape[1] != chunks * cfg.chunk_frames:
        raise MediaError(
            f"Voxtral's encoder takes {cfg.chunk_frames} frames per 30 s; its config does not "
            "match Whisper's 10 ms hop."
        )
    return np.ascontiguousarray(feats.reshape(cfg.num_mel_bins, chunks, cfg.chunk_frames).transpose(1, 0, 2))


class Projector(nn.Module):
    def __init__(self, d_in: int, d_text: int, act: str) -> None:
        super().__init__()
        if act != "gelu":
            raise UnsupportedModelError(f"Voxtral projector activation {act!r} is not supported (only 'gelu').")
        self.linear_1 = nn.Linear(d_in, d_text, bias=False)
        self.linear_2 = nn.Linear(d_text, d_text, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(nn.gelu(self.linear_1(x)))


class VoxtralTower(nn.Module):
    def __init__(self, cfg: VoxtralEncoderConfig, text_hidden: int, projector_act: str = "gelu") -> None:
        super().__init__()
        self.config = cfg
        self.encoder = WhisperEncoder(cfg.whisper())
        self.projector = Projector(cfg.intermediate_size, text_hidden, projector_act)

    def __call__(self, features: mx.array | np.ndarray) -> mx.array:
        """(chunks, n_mels, 3000) features -> (chunks * tokens_per_chunk, text hidden)."""
        features = np.asarray(features) if not isinstance(features, mx.array) else features
        if features.ndim == 2:
            features = features[None]
        dtype = self.encoder.conv1.weight.dtype
        rows = []
        # One chunk at a time: attention over 1500 positions is the memory peak, and a
        # long clip's chunks do not see each other anyway.
        for i in range(features.shape[0]):
            hidden = self.encoder(mx.array(features[i : i + 1]).astype(dtype))
            grouped = hidden.reshape(-1, self.config.intermediate_size)
            out = self.projector(grouped)
            mx.eval(out)
            rows.append(out)
        return mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def embed_audio(self, samples: np.ndarray) -> mx.array:
        return self(clip_features(samples, self.config))


def sanitize_tower(weights: Mapping[str, Any], cfg: VoxtralEncoderConfig) -> dict[str, Any]:
    """Names already renamed to encoder./projector.; conv kernels to MLX's channels-last
    layout unless a conversion stored them that way already."""
    return {name: conv_kernel(name, value, cfg.hidden_size, cfg.num_mel_bins) for name, value in weights.items()}


# ---- the shared media plumbing (engine.media.towers) --------------------------------


class VoxtralEncoder(LazyTowerEncoder):
    """The MediaEncoder for Voxtral clips.

    The chat template writes ``[BEGIN_AUDIO][AUDIO]`` per clip; as mistral-common does
    for VoxtralProcessor, the lone [AUDIO] becomes 375 of them per 30 s chunk. Features
    are computed here without weights; the tower loads on the first ``encode``.
    """

    kind = "audio"
    placeholder = AUDIO_PAD
    renames = AUDIO_TOWER_RENAMES
    what = "Voxtral audio tower"

    def __init__(self, source: TowerSource) -> None:
        raw = source.config.raw
        self.source = source
        self.config = VoxtralEncoderConfig.from_dict(raw.get("audio_config"))
        token = raw.get("audio_token_id")
        self.token_id = int(token) if token is not None else 24
        self.text_hidden = int(source.config.text.get("hidden_size") or raw.get("hidden_size"))
        self.projector_act = str(raw.get("projector_hidden_act", "gelu"))

    def prepare(self, item: Any) -> Any:
        from engine.media.audio import load_audio_source
        from engine.media.encoded_cache import media_key
        from engine.media.prompt import PreparedMedia

        feats = clip_features(load_audio_source(item.source, WHISPER_SAMPLE_RATE), self.config)
        n = feats.shape[0] * self.config.tokens_per_chunk
        settings = {
            "model": str(self.source.path),
            "tower": "voxtral",
            "mels": self.config.num_mel_bins,
            "rate": WHISPER_SAMPLE_RATE,
            "seconds": WHISPER_CHUNK_SECONDS,
        }
        return PreparedMedia(kind="audio", key=media_key(item, settings), n_tokens=n, text=AUDIO_PAD * n, data=feats)

    def build(self) -> VoxtralTower:
        return VoxtralTower(self.config, self.text_hidden, self.projector_act)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return sanitize_tower(weights, self.config)

    def run(self, module: VoxtralTower, item: Any) -> mx.array:
        return module(item.data)


def make_encoder(source: TowerSource) -> VoxtralEncoder:
    return VoxtralEncoder(source)
