"""A tiny DiffusionGemma model folder the app and the CLI can load: the random
transformers checkpoint of tests/golden/diffusion_gemma (vocabulary 256, blocks of 8)
with tests/tiny_models.py's byte-level tokenizer and ChatML template, trained to 256
entries so every id the model writes has text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.tiny_models import make_tiny_llama

GOLDEN = Path(__file__).resolve().parent / "golden" / "diffusion_gemma" / "diffusion_gemma_tiny"


def make_tiny_diffusion_gemma(folder: Path, *, steps: int = 6) -> Path:
    """The folder, with denoising settings under which every block takes all ``steps``
    steps (never confident enough to stop early), so a block is seen refining."""
    folder = Path(folder)
    make_tiny_llama(folder, vocab_size=256)  # tokenizer files and chat template
    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / name, folder / name)
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": eos,
                "max_denoising_steps": steps,
                "stability_threshold": 0,
                "confidence_threshold": 1e-9,
            }
        )
    )
    return folder
