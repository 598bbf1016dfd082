"""Qwen2-Audio's ears: a Whisper encoder, average-pooled by 2, projected into the LM.

The clip is cut or padded to 30 s of 128-bin log-mel features (3000 frames), exactly as
transformers' processor does; frames past the real audio are kept out of attention as
keys. After the convolutions (1500 positions) and the transformer layers, pairs of
positions are averaged (750), layer-normed, and a linear projector maps them to the
language model's width. Only the first ``audio_token_count(frames)`` of them describe
real audio: the processor writes that many <|AUDIO|> placeholders into the prompt.

Weight names follow the Hub checkpoints (``audio_tower.*``, ``multi_modal_projector.*``)
or transformers 5's spelling under ``model.``; the tower loads from the model folder on
the first audio request, so text-only chats never pay for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.artifacts.config_fields import from_known_keys
from engine.errors import MediaError, ModelLoadError
from engine.media.mel import WHISPER_CHUNK_SECONDS, WHISPER_HOP_LENGTH, WHISPER_SAMPLE_RATE, log_mel_spectrogram
from engine.media.whisper.model import AUDIO_TOWER_RENAMES, WhisperConfig, WhisperEncoder, conv_kernel


@dataclass
class AudioEncoderConfig:
    """transformers' Qwen2AudioEncoderConfig, with its defaults (the 7B models' shape)."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None) -> AudioEncoderConfig:
        return from_known_keys(cls, config)

    def whisper(self) -> WhisperConfig:
        # The same encoder as Whisper's, with no decoder behind it.
        return WhisperConfig.from_dict({**dataclasses.asdict(self), "decoder_layers": 0, "vocab_size": 1})


_CHUNK_FRAMES = WHISPER_CHUNK_SECONDS * WHISPER_SAMPLE_RATE // WHISPER_HOP_LENGTH


def feature_frames(n_samples: int, max_frames: int = _CHUNK_FRAMES) -> int:
    """Frames holding real audio (the processor's feature_attention_mask sum)."""
    return min(max_frames, -(-n_samples // WHISPER_HOP_LENGTH))


def audio_token_count(frames: int) -> int:
    """Placeholders for ``frames`` real feature frames: stride-2 convolution, then pooling by 2."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def clip_features(samples: np.ndarray, cfg: AudioEncoderConfig) -> tuple[np.ndarray, int]:
    """16 kHz mono samples -> (log-mel features (n_mels, 3000), real frames). Needs no
    weights, so a prompt can be laid out before the tower is loaded."""
    if samples.shape[0] == 0:
        raise MediaError("The audio clip is empty.")
    frames = feature_frames(samples.shape[0], 2 * cfg.max_source_positions)
    if audio_token_count(frames) < 1:
        raise MediaError(
            f"The audio clip is too short ({samples.shape[0] / WHISPER_SAMPLE_RATE:.3f} s); "
            "record at least a twentieth of a second."
        )
    feats = log_mel_spectrogram(samples, n_mels=cfg.num_mel_bins, chunk_seconds=WHISPER_CHUNK_SECONDS)
    return feats, frames


class AudioEncoder(WhisperEncoder):
    """Whisper's encoder with a key-padding mask and average pooling before the final norm."""

    def __call__(self, features: mx.array, valid: int | None = None) -> mx.array:
        """(1, n_mels, frames) -> (1, positions // 2, d_model); ``valid`` positions (after the
        stride-2 convolution) are real audio, the rest are masked as keys."""
        x = features.transpose(0, 2, 1)
        x = nn.gelu(self.conv1(x))
        x = nn.gelu(self.conv2(x))
        n = x.shape[1]
        x = x + self.embed_positions.weight[:n]
        mask = None
        if valid is not None and valid < n:
            keep = mx.arange(n) < valid
            mask = mx.where(keep, 0.0, -mx.inf).astype(x.dtype)[None, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        b, t, d = x.shape
        x = x[:, : t - t % 2].reshape(b, t // 2, 2, d).mean(axis=2)
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, d_audio: int, d_text: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_audio, d_text)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)


class Qwen2AudioTower(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = AudioEncoder(cfg.whisper())
        self.projector = Projector(cfg.d_model, text_hidden)

    @property
    def frames(self) -> int:
        return 2 * self.config.max_source_positions

    def features(self, samples: np.ndarray) -> tuple[np.ndarray, int]:
        """16 kHz mono samples -> (log-mel features (n_mels, 3000), real frames)."""
        return clip_features(samples, self.config)

    def __call__(self, features: mx.array | np.ndarray, frames: int) -> mx.array:
        """Projected audio embeddings for one clip: (audio_token_count(frames), text hidden)."""
        features = mx.array(features)
        if features.ndim == 2:
            features = features[None]
        dtype = self.encoder.conv1.weight.dtype
        valid = (frames - 1) // 2 + 1
        hidden = self.encoder(features.astype(dtype), valid)
        return self.projector(hidden[0, : audio_token_count(frames)])

    def embed_audio(self, samples: np.ndarray) -> mx.array:
        feats, frames = self.features(samples)
        return self(feats, frames)

    # ---- weights --------------------------------------------------------------------

    @staticmethod
    def tower_weight_names(names: Any) -> list[str]:
        return [n for n in names if n.startswith(tuple(p for p, _ in AUDIO_TOWER_RENAMES))]

    def sanitize(self, weights: Mapping[str, Any]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        d, mels = self.config.d_model, self.config.num_mel_bins
        for name, value in weights.items():
            for old, new in AUDIO_TOWER_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            else:
                continue
            out[name] = mx.array(conv_kernel(name, value, d, mels))
        return out

    def load_hf_weights(self, weights: Mapping[str, Any]) -> None:
        try:
            self.load_weights(list(self.sanitize(weights).items()), strict=True)
        except ValueError as e:
            raise ModelLoadError(f"Qwen2-Audio's audio tower weights do not fit its config: {e}") from None
        mx.eval(self.parameters())

    @classmethod
    def from_folder(
        cls, folder: str | Path, audio_config: Mapping[str, Any] | None, text_hidden: int, dtype: Any = None
    ) -> Qwen2AudioTower:
        """Read only the tower's tensors from a model folder's safetensors."""
        from engine.artifacts.weights import find_weights, load_weights

        tower = cls(AudioEncoderConfig.from_dict(audio_config), text_hidden)
        weights = load_weights(find_weights(Path(folder)))
        names = cls.tower_weight_names(weights)
        if not names:
            raise ModelLoadError(
                f"{Path(folder).name} has no audio_tower weights; download the full Qwen2-Audio checkpoint."
            )
        picked = {n: weights[n] for n in names}
        if dtype is not None:
            picked = {n: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w for n, w in picked.items()}
        tower.load_hf_weights(picked)
        return tower


# ---- the shared media plumbing (engine.media.towers) --------------------------------

AUDIO_PAD = "<|AUDIO|>"


class Qwen2AudioEncoder:
    """The MediaEncoder for Qwen2-Audio clips.

    The chat template writes ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip; as
    transformers' Qwen2AudioProcessor does, the lone ``<|AUDIO|>`` becomes one per
    projected position of real audio. Features are computed here without weights; the
    tower loads on the first ``encode``.
    """

    kind = "audio"
    placeholder = AUDIO_PAD

    def __init__(self, source: Any) -> None:
        raw = source.config.raw
        self.source = source
        self.config = AudioEncoderConfig.from_dict(raw.get("audio_config"))
        self.token_id = int(raw.get("audio_token_index", raw.get("audio_token_id", 151646)))
        self.text_hidden = int(source.config.text.get("hidden_size") or raw.get("hidden_size"))
        self.module: Qwen2AudioTower | None = None
        self.calls = 0

    @property
    def loaded(self) -> bool:
        return self.module is not None

    def prepare(self, item: Any) -> Any:
        from engine.media.audio import load_audio_source
        from engine.media.encoded_cache import media_key
        from engine.media.prompt import PreparedMedia

        feats, frames = clip_features(load_audio_source(item.source, WHISPER_SAMPLE_RATE), self.config)
        n = audio_token_count(frames)
        settings = {
            "model": str(self.source.path),
            "tower": "qwen2_audio",
            "mels": self.config.num_mel_bins,
            "rate": WHISPER_SAMPLE_RATE,
            "seconds": WHISPER_CHUNK_SECONDS,
        }
        return PreparedMedia(
            kind="audio", key=media_key(item, settings), n_tokens=n, text=AUDIO_PAD * n, data=(feats, frames)
        )

    def load(self) -> Qwen2AudioTower:
        if self.module is None:
            from engine.artifacts.weights import load_weights
            from engine.media.towers import fill_tower

            module = Qwen2AudioTower(self.config, self.text_hidden)
            weights = module.sanitize(load_weights(self.source.weight_files()))
            if not weights:
                raise MediaError(
                    f"{self.source.name} is an audio model but its weights hold no audio_tower; "
                    "download the full Qwen2-Audio checkpoint, not a text-only conversion."
                )
            fill_tower(module, weights, self.source, "Qwen2-Audio audio tower")
            self.module = module
        return self.module

    def encode(self, item: Any) -> mx.array:
        module = self.load()
        self.calls += 1
        feats, frames = item.data
        return module(feats, frames)


def tower_for(model: Any, folder: str | Path) -> Qwen2AudioTower:
    """The audio tower and projector of a loaded Qwen2-Audio ``model``, read from its folder."""
    dtype = model.model.embed_tokens.weight.dtype
    return Qwen2AudioTower.from_folder(folder, model.args.audio_config, model.args.hidden_size, dtype)


def make_encoder(source: Any) -> Qwen2AudioEncoder:
    return Qwen2AudioEncoder(source)
