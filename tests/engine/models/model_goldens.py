"""Load the tiny golden checkpoints (made by tests/golden/make_model_goldens.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from engine.models import get_family

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "models"
FAMILIES = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected.json").is_file())


def load_golden(name: str):
    """(model, expected) for one golden folder, weights upcast to float32."""
    folder = GOLDEN / name
    config = json.loads((folder / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    expected = json.loads((folder / "expected.json").read_text())
    return model, expected


def greedy(model, prompt: list[int], n: int):
    """Prefill, then decode one token at a time through the model's own caches."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    ids, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        logprobs.append(float(lp[0, token].item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return ids, logprobs
