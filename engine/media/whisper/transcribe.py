"""Speech to text with a Whisper checkpoint, for models that cannot hear audio themselves.

A checkpoint is a Hugging Face Whisper folder (config.json, model.safetensors,
tokenizer.json, generation_config.json, preprocessor_config.json), e.g. openai/whisper-tiny.
Decoding is greedy, with the generation config's ``suppress_tokens`` masked at every step
and ``begin_suppress_tokens`` at the first one, as transformers' ``generate`` does. The
language is given, or detected once on the first 30 s (the most likely language token
after <|startoftranscript|>) and kept for the rest.

Audio up to 30 s (Whisper's receptive field) is one window decoded after
<|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|>, unless timestamps are asked
for. Longer audio is decoded the way transformers' long-form ``generate`` does it: mel
features of the whole clip, a 30 s window at a time, with timestamp tokens (see
timestamps.py); each window's pairs of timestamps close segments, and the next window
starts at the last closed segment's end rather than 30 s on, so words are not cut in half.
There is no temperature fallback and no conditioning on the previous window's text
(transformers' defaults).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import Transcript, TranscriptSegment
from engine.errors import EngineError, ModelLoadError, UnsupportedModelError
from engine.media.audio import load_audio
from engine.media.mel import log_mel_spectrogram
from engine.media.whisper.timestamps import INPUT_STRIDE, TimestampRules, split_window

WHISPER_ENV = "MLX_DESK_WHISPER"
_LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3}(?:_[a-z]+)?)\|>$")
# Whisper's English-only checkpoints have one token fewer than the multilingual ones.
_MULTILINGUAL_VOCAB = 51865

WindowProgress = Callable[[int, int], None]


class NoWhisperModel(EngineError):
    """Audio has to be transcribed, but no Whisper model was chosen."""


def no_whisper_message(what: str = "This model cannot take audio") -> str:
    return (
        f"{what}: choose a Whisper model to transcribe it (a Hugging Face Whisper folder or cached "
        f"repo id such as openai/whisper-tiny), with --whisper PATH or the {WHISPER_ENV} environment "
        "variable, or pick a model that understands audio (Qwen2-Audio)."
    )


@dataclass
class WhisperSettings:
    """What decoding needs from generation_config.json and preprocessor_config.json."""

    start_id: int
    eos_id: int
    no_timestamps_id: int | None = None
    transcribe_id: int | None = None
    lang_to_id: dict[str, int] = field(default_factory=dict)  # "en" -> id of <|en|>
    multilingual: bool = False
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    max_length: int = 448
    max_initial_timestamp_index: int | None = None  # the first timestamp is at most this many steps in
    n_mels: int = 80
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_seconds: int = 30


def _read_json(path: Path) -> dict[str, Any]:
    from engine.artifacts.config import read_json

    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _first_int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, list) and v:
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def read_settings(folder: Path, config: Mapping[str, Any], tokenizer: Any) -> WhisperSettings:
    """Settings from the folder's JSON files, falling back on the tokenizer's special tokens."""
    gen = _read_json(folder / "generation_config.json")
    pre = _read_json(folder / "preprocessor_config.json")

    def token(text: str) -> int | None:
        return tokenizer.token_to_id(text)

    start = _first_int(
        gen.get("decoder_start_token_id"), config.get("decoder_start_token_id"), token("<|startoftranscript|>")
    )
    eos = _first_int(gen.get("eos_token_id"), config.get("eos_token_id"), token("<|endoftext|>"))
    if start is None or eos is None:
        raise ModelLoadError(
            f"{folder.name} does not say which tokens start and end a transcript "
            "(no decoder_start_token_id / eos_token_id); download the model's generation_config.json."
        )
    langs = gen.get("lang_to_id")
    if isinstance(langs, dict) and langs:
        lang_to_id = {
            _LANGUAGE_TOKEN.match(k).group(1) if _LANGUAGE_TOKEN.match(k) else k: int(v) for k, v in langs.items()
        }
    else:  # older folders: the <|xx|> special tokens of the vocabulary
        lang_to_id = {}
        for tid in sorted(getattr(tokenizer, "special_token_ids", ())):
            m = _LANGUAGE_TOKEN.match(tokenizer.id_to_token(tid) or "")
            if m:
                lang_to_id[m.group(1)] = tid
    multilingual = gen.get("is_multilingual")
    if not isinstance(multilingual, bool):
        multilingual = int(config.get("vocab_size") or 0) >= _MULTILINGUAL_VOCAB and bool(lang_to_id)
    tasks = gen.get("task_to_id") if isinstance(gen.get("task_to_id"), dict) else {}
    chunk = pre.get("chunk_length", 30)
    return WhisperSettings(
        start_id=start,
        eos_id=eos,
        no_timestamps_id=_first_int(gen.get("no_timestamps_token_id"), token("<|notimestamps|>")),
        transcribe_id=_first_int(tasks.get("transcribe"), token("<|transcribe|>")),
        lang_to_id=lang_to_id,
        multilingual=multilingual,
        suppress_tokens=[int(t) for t in gen.get("suppress_tokens") or []],
        begin_suppress_tokens=[int(t) for t in gen.get("begin_suppress_tokens") or []],
        max_length=int(gen.get("max_length") or config.get("max_target_positions") or 448),
        max_initial_timestamp_index=_first_int(gen.get("max_initial_timestamp_index")),
        n_mels=int(pre.get("feature_size") or config.get("num_mel_bins") or 80),
        sample_rate=int(pre.get("sampling_rate") or 16000),
        n_fft=int(pre.get("n_fft") or 400),
        hop_length=int(pre.get("hop_length") or 160),
        chunk_seconds=int(chunk) if isinstance(chunk, (int, float)) and chunk > 0 else 30,
    )


class Transcriber:
    """A loaded Whisper model with its tokenizer and decoding settings."""

    def __init__(
        self, model: Any, tokenizer: Any, settings: WhisperSettings, *, name: str = "whisper", path: str = ""
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.name = name
        self.path = path
        vocab = model.config.vocab_size
        self._suppress = self._mask(settings.suppress_tokens, vocab)
        self._begin_suppress = self._mask(settings.suppress_tokens + settings.begin_suppress_tokens, vocab)
        timestamps = settings.no_timestamps_id + 1 if settings.no_timestamps_id is not None else vocab
        special = set(getattr(tokenizer, "special_token_ids", ()))
        self._is_text = lambda i: i < timestamps and i not in special and i != settings.eos_id

    @staticmethod
    def _mask(ids: list[int], vocab: int) -> Any:
        import mlx.core as mx

        mask = np.zeros(vocab, dtype=np.float32)
        mask[[i for i in ids if 0 <= i < vocab]] = -np.inf
        return mx.array(mask)

    # ---- loading ----------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Transcriber:
        """Load a Whisper folder or cached Hugging Face repo id; errors say what to do."""
        from engine.artifacts.config import read_json
        from engine.artifacts.hub import model_name, resolve_model_path
        from engine.artifacts.weights import find_weights, load_weights
        from engine.media.whisper.model import Whisper, WhisperConfig
        from engine.text.tokenizer import Tokenizer

        folder = resolve_model_path(path)
        if folder.is_file():
            raise UnsupportedModelError(
                f"{folder.name} is a single file; transcription needs a Hugging Face Whisper folder "
                "(config.json, model.safetensors, tokenizer.json), e.g. openai/whisper-tiny."
            )
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(
                f"{folder} has no config.json; transcription needs a Hugging Face Whisper folder "
                "such as openai/whisper-tiny (MLX-format weights.npz folders are not read)."
            )
        config = read_json(config_file)
        if not isinstance(config, dict) or config.get("model_type") != "whisper":
            kind = config.get("model_type") if isinstance(config, dict) else None
            raise UnsupportedModelError(
                f"{folder.name} is not a Whisper model (model_type {kind!r}); choose a Whisper checkpoint "
                "such as openai/whisper-tiny for transcription."
            )
        tokenizer = Tokenizer.from_dir(folder)
        settings = read_settings(folder, config, tokenizer)
        model = Whisper(WhisperConfig.from_dict(config))
        if settings.n_mels != model.config.num_mel_bins:
            raise ModelLoadError(
                f"{folder.name}: preprocessor_config.json asks for {settings.n_mels} mel bins but the model "
                f"takes {model.config.num_mel_bins}; download the model again."
            )
        model.load_hf_weights(load_weights(find_weights(folder)))
        return cls(model, tokenizer, settings, name=model_name(folder), path=str(folder))

    # ---- languages ----------------------------------------------------------------

    @property
    def languages(self) -> list[str]:
        """Language codes this model can be told to transcribe (empty: English only)."""
        return sorted(self.settings.lang_to_id) if self.settings.multilingual else []

    def _language_id(self, language: str) -> int:
        code = language.strip().lower()
        m = _LANGUAGE_TOKEN.match(code)
        code = m.group(1) if m else code
        if not self.settings.multilingual:
            if code == "en":
                return -1
            raise EngineError(f"{self.name} transcribes English only; choose a multilingual Whisper for {language!r}.")
        if code not in self.settings.lang_to_id:
            raise EngineError(
                f"{self.name} does not know language {language!r}; use a code such as "
                f"{', '.join(sorted(self.settings.lang_to_id)[:8])}."
            )
        return self.settings.lang_to_id[code]

    def detect_language(self, encoded: Any) -> str:
        """The language token Whisper finds most likely right after <|startoftranscript|>."""
        import mlx.core as mx

        ids = list(self.settings.lang_to_id.values())
        logits = self.model.logits(mx.array([[self.settings.start_id]]), encoded, self.model.make_cache())[0, -1]
        best = ids[int(mx.argmax(logits[mx.array(ids)]).item())]
        return next(code for code, tid in self.settings.lang_to_id.items() if tid == best)

    def prompt_ids(self, language: str | None, timestamps: bool = False) -> list[int]:
        """<|startoftranscript|> [<|lang|> <|transcribe|>] [<|notimestamps|> unless ``timestamps``]."""
        s = self.settings
        prompt = [s.start_id]
        if s.multilingual and language is not None:
            prompt.append(self._language_id(language))
            if s.transcribe_id is not None:
                prompt.append(s.transcribe_id)
        if s.no_timestamps_id is not None and not timestamps:
            prompt.append(s.no_timestamps_id)
        return prompt

    def timestamp_rules(self) -> TimestampRules:
        s = self.settings
        if s.no_timestamps_id is None or s.no_timestamps_id + 1 >= self.model.config.vocab_size:
            raise EngineError(
                f"{self.name} has no timestamp tokens (no <|notimestamps|> followed by <|0.00|>), so it cannot "
                "give times or transcribe audio over 30 s; use a Whisper checkpoint with timestamps."
            )
        return TimestampRules(s.no_timestamps_id + 1, s.no_timestamps_id, s.eos_id, s.max_initial_timestamp_index)

    # ---- decoding ---------------------------------------------------------------

    @property
    def window_frames(self) -> int:
        """Mel frames in one window: what the encoder's positions cover (3000 for 30 s)."""
        return INPUT_STRIDE * self.model.config.max_source_positions

    def features(self, samples: np.ndarray, whole: bool = False) -> np.ndarray:
        """Log-mel features of one 30 s window (cut or padded), or with ``whole`` of the
        entire clip (long-form: its own length, normalised over all of it)."""
        s = self.settings
        return log_mel_spectrogram(
            samples,
            n_mels=s.n_mels,
            n_fft=s.n_fft,
            hop_length=s.hop_length,
            sample_rate=s.sample_rate,
            chunk_seconds=None if whole else s.chunk_seconds,
        )

    def encode_features(self, features: np.ndarray) -> Any:
        import mlx.core as mx

        dtype = self.model.encoder.conv1.weight.dtype
        return self.model.encode(mx.array(features).astype(dtype))

    def encode(self, samples: np.ndarray) -> Any:
        return self.encode_features(self.features(samples))

    def decode(
        self,
        encoded: Any,
        prompt: list[int],
        max_new_tokens: int | None = None,
        cancel: threading.Event | None = None,
        rules: TimestampRules | None = None,
    ) -> list[int]:
        """Greedy ids after ``prompt`` (the end-of-text token not included); ``rules`` (after
        suppression, as the reference orders them) when decoding with timestamps."""
        import mlx.core as mx

        # With timestamps the caller applies the generation config's max_length (its rule differs).
        limit = (
            self.model.config.max_target_positions
            if rules is not None
            else min(self.settings.max_length, self.model.config.max_target_positions)
        ) - len(prompt)
        steps = limit if max_new_tokens is None else min(max_new_tokens, limit)
        cache = self.model.make_cache()
        ids = mx.array([prompt], dtype=mx.int32)
        out: list[int] = []
        for step in range(max(0, steps)):
            if cancel is not None and cancel.is_set():
                break
            logits = self.model.logits(ids, encoded, cache)[0, -1].astype(mx.float32)
            logits = logits + (self._begin_suppress if step == 0 else self._suppress)
            if rules is None:
                next_id = int(mx.argmax(logits).item())
            else:
                next_id = int(np.argmax(rules.apply(out, np.array(logits))))
            if next_id == self.settings.eos_id:
                break
            out.append(next_id)
            ids = mx.array([[next_id]], dtype=mx.int32)
        return out

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if self._is_text(i)], skip_special_tokens=True).strip()

    def transcribe(
        self,
        audio: str | Path | np.ndarray,
        *,
        language: str | None = None,
        max_new_tokens: int | None = None,
        timestamps: bool = False,
        on_window: WindowProgress | None = None,
        cancel: threading.Event | None = None,
    ) -> Transcript:
        """Transcribe a file (decoded and resampled to the model's rate) or mono samples at
        that rate. Audio over 30 s, or any audio with ``timestamps``, is decoded with
        timestamp tokens into timed segments; otherwise one segment spans the clip.
        ``on_window(done, total)`` follows each window (for long audio ``total`` is an
        estimate until the end); a set ``cancel`` ends the work early with the windows
        finished so far (finish_reason "cancelled")."""
        s = self.settings
        if language is not None:
            self._language_id(language)  # refuse an unknown language before any work
        samples = load_audio(audio, s.sample_rate) if isinstance(audio, (str, Path)) else np.asarray(audio, np.float32)
        if samples.ndim != 1:
            raise EngineError(f"transcribe takes mono samples, got an array of shape {samples.shape}")
        long_form = samples.shape[0] // s.hop_length > self.window_frames
        if long_form or timestamps:
            rules = self.timestamp_rules()  # refuse a checkpoint without timestamps before any work
            features = self.features(samples, whole=long_form)
            segments, detected, cancelled = self._decode_windows(
                features, rules, language, max_new_tokens, on_window, cancel
            )
        else:
            segments, detected, cancelled = self._decode_one(samples, language, max_new_tokens, on_window, cancel)
        text = " ".join(seg.text for seg in segments if seg.text)
        return Transcript(
            text=text,
            language=(detected.strip("<|>").lower() if detected else ("en" if not s.multilingual else None)),
            duration_s=samples.shape[0] / s.sample_rate,
            segments=segments,
            finish_reason="cancelled" if cancelled else "stop",
            model=self.name,
        )

    def _language_for(self, encoded: Any, language: str | None) -> str | None:
        s = self.settings
        if language is None and s.multilingual and s.lang_to_id:
            return self.detect_language(encoded)
        return language

    def _decode_one(
        self,
        samples: np.ndarray,
        language: str | None,
        max_new_tokens: int | None,
        on_window: WindowProgress | None,
        cancel: threading.Event | None,
    ) -> tuple[list[TranscriptSegment], str | None, bool]:
        """Up to 30 s without timestamps: one window, one segment over the clip."""
        if cancel is not None and cancel.is_set():
            return [], language, True
        encoded = self.encode(samples)
        language = self._language_for(encoded, language)
        ids = self.decode(encoded, self.prompt_ids(language), max_new_tokens, cancel)
        segment = TranscriptSegment(0.0, samples.shape[0] / self.settings.sample_rate, self.text_of(ids), ids)
        if on_window is not None:
            on_window(1, 1)
        return [segment], language, cancel is not None and cancel.is_set()

    def _decode_windows(
        self,
        features: np.ndarray,
        rules: TimestampRules,
        language: str | None,
        max_new_tokens: int | None,
        on_window: WindowProgress | None,
        cancel: threading.Event | None,
    ) -> tuple[list[TranscriptSegment], str | None, bool]:
        """Sequential long-form decoding over ``features`` (n_mels, frames): each window is
        the next 30 s from ``seek`` (zero-padded features past the end), and ``seek`` moves to
        where the window's last closed segment ended."""
        s = self.settings
        total, width = features.shape[1], self.window_frames
        seek, done = 0, 0
        max_length = s.max_length
        segments: list[TranscriptSegment] = []
        while seek < total:
            if cancel is not None and cancel.is_set():
                return segments, language, True
            frames = min(total - seek, width)
            window = np.zeros((features.shape[0], width), dtype=np.float32)
            window[:, :frames] = features[:, seek : seek + frames]
            encoded = self.encode_features(window)
            language = self._language_for(encoded, language)
            prompt = self.prompt_ids(language, timestamps=True)
            if max_new_tokens is None:
                # The reference lets max_length grow by the prompt's length at every window
                # (up to the decoder's positions); with real checkpoints it is the cap at once.
                max_length = min(max_length + len(prompt), self.model.config.max_target_positions)
                steps = max_length - len(prompt)
            else:
                steps = max_new_tokens
            ids = self.decode(encoded, prompt, steps, cancel, rules)
            if cancel is not None and cancel.is_set():
                return segments, language, True
            pieces, advance = split_window(ids, rules.timestamp_begin, seek, frames)
            segments += [TranscriptSegment(p.start_s, p.end_s, self.text_of(p.token_ids), p.token_ids) for p in pieces]
            seek += advance if advance > 0 else frames  # the rules make advance >= 2; never stall
            done += 1
            if on_window is not None:
                on_window(done, done + -(-max(0, total - seek) // width))
        return segments, language, False
