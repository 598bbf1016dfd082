"""Tiny random checkpoints rebuilt from the golden metadata (tests/golden/make_audio_goldens.py).

Weights come from ``synthetic_weight``, the same seeded generator (keyed by parameter
name) the golden script filled the transformers models with; the folders are written
in the layout a Hugging Face download has.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "media"


def synthetic_weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    noise = np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape)
    if name.endswith(("layer_norm.weight", "norm.weight", "layernorm.weight")):
        return (1.0 + 0.1 * noise).astype(np.float32)
    if name.endswith(".bias"):
        return (0.05 * noise).astype(np.float32)
    if "embed_positions" in name:
        return (2.0 * noise).astype(np.float32)
    if "embed_tokens" in name:
        return (0.5 * noise).astype(np.float32)
    return (noise / math.sqrt(math.prod(shape[1:]))).astype(np.float32)


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
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", *meta["specials"]]])
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False)
                    for i in range(meta["n_timestamps"])])
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
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"feature_size": meta["config"]["num_mel_bins"], "sampling_rate": 16000, "n_fft": 400,
         "hop_length": 160, "chunk_length": 30}))
    return folder
