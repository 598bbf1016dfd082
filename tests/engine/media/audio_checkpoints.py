"""Tiny random checkpoints rebuilt from the golden metadata (tests/golden/make_audio_goldens.py).

Weights come from ``synthetic_weight``, the same seeded generator (keyed by parameter
name) the golden script filled the transformers models with; the folders are written
in the layout a Hugging Face download has.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from golden.synthetic_weights import synthetic_weight
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"


def load_meta(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def load_arrays(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


# ---- Whisper for transcription ---------------------------------------------------


def whisper_tokenizer(meta: dict) -> Tokenizer:
    """Word-level vocabulary: w0..w99, Whisper's specials after them, then timestamps;
    <|endoftext|> sits where the golden script put it."""
    n, eot = meta["n_ordinary"], meta["config"]["eos_token_id"]
    vocab = {f"w{i}": i for i in range(n) if i != eot}
    vocab["<|endoftext|>"] = eot
    for i, tok in enumerate(meta["specials"]):
        vocab[tok] = n + i
    first_ts = n + len(meta["specials"])
    for i in range(meta["n_timestamps"]):
        vocab[f"<|{i * 0.02:.2f}|>"] = first_ts + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ["<|endoftext|>", *meta["specials"]]]
    )
    tok.add_tokens(
        [AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(meta["n_timestamps"])]
    )
    return tok


def write_whisper_folder(folder: Path, meta: dict | None = None, *, generation_config: bool = True) -> Path:
    meta = meta or load_meta("whisper_asr")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(meta["config"]))
    weights = {name: synthetic_weight(name, tuple(shape)) for name, shape in meta["parameters"].items()}
    weights["proj_out.weight"] = weights["model.decoder.embed_tokens.weight"].copy()
    save_file(weights, str(folder / "model.safetensors"))
    whisper_tokenizer(meta).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    if generation_config:
        (folder / "generation_config.json").write_text(json.dumps(meta["generation_config"]))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_size": meta["config"]["num_mel_bins"],
                "sampling_rate": 16000,
                "n_fft": 400,
                "hop_length": 160,
                "chunk_length": 30,
            }
        )
    )
    return folder


# ---- Qwen2-Audio -----------------------------------------------------------------


def qwen_tokenizer(meta: dict) -> Tokenizer:
    """The golden script's word-level vocabulary, specials (with <|AUDIO|>) at the end."""
    vocab = {w: i for i, w in enumerate(meta["words"])}
    for w in ["\n", ":", *[str(d) for d in range(10)], "Audio", "user", "assistant", "system", "[UNK]"]:
        vocab[w] = len(vocab)
    for i in range(len(vocab), meta["vocab_size"] - len(meta["specials"])):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in meta["specials"]])
    return tok


def hub_name(name: str) -> str:
    """transformers 5's parameter names -> the names Qwen2-Audio checkpoints on the Hub use."""
    for old, new in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def write_qwen2_audio_folder(folder: Path, meta: dict | None = None, *, hub_names: bool = True) -> Path:
    meta = meta or load_meta("qwen2_audio_tiny")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(meta["config"]))
    weights = {
        (hub_name(n) if hub_names else n): synthetic_weight(n, tuple(shape)) for n, shape in meta["parameters"].items()
    }
    save_file(weights, str(folder / "model.safetensors"))
    qwen_tokenizer(meta).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": meta["chat_template"],
                "add_bos_token": False,
            }
        )
    )
    return folder
