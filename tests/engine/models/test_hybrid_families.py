"""The hybrid families (recurrent layers beside attention) against their referees.

* transformers 5.23, in both config spellings (its own, and the published repos' with the
  multimodal weight names where those apply): greedy ids identical, log-probs within
  1e-3 over an 80-token prompt (past transformers' 64-token delta-rule chunks);
* mlx-lm 0.32's own 4-bit conversion, loaded through the engine's loader, against
  mlx-lm's own greedy decoding of it: ids identical, log-probs within 2e-3;
* chunked prefill (chunks of 3, 7 and 64 tokens) equals one pass.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from model_goldens import GOLDEN

from engine.models import get_family
from engine.models.recurrent_cache import RecurrentCache
from engine.runtime.loading import load_model

HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe"]
TOLERANCE = 1e-3
MLX_TOLERANCE = 2e-3


def build(name: str, spelling: str = "config.json"):
    folder = GOLDEN / name
    config = json.loads((folder / spelling).read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    if spelling != "config.json" and "text_config" in config:
        # The published multimodal checkpoints nest the language model and carry a vision
        # tower beside it (their MTP layers: tests/engine/speculative/test_mtp.py).
        weights = {
            ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
            for k, v in weights.items()
        }
        weights["model.visual.patch_embed.proj.weight"] = mx.zeros((4, 4))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model, json.loads((folder / "expected.json").read_text())


def greedy(model, prompt: list[int], n: int, chunk: int | None = None):
    cache = model.make_cache()
    step = chunk or len(prompt)
    for start in range(0, len(prompt), step):
        logits = model(mx.array([prompt[start : start + step]]), cache=cache)[:, -1]
    ids, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(mx.argmax(lp, axis=-1).item())
        ids.append(token)
        logprobs.append(float(lp[0, token].item()))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return ids, logprobs


def assert_matches(ids, logprobs, expected, tolerance, what):
    assert ids == expected["greedy_ids"], what
    worst = max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"]))
    assert worst < tolerance, f"{what}: log-prob differs by {worst}"


@pytest.mark.parametrize("spelling", ["config.json", "config.published.json"])
@pytest.mark.parametrize("name", HYBRID)
def test_greedy_matches_transformers(name, spelling):
    model, expected = build(name, spelling)
    assert len(expected["prompt_ids"]) > 64
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert_matches(ids, logprobs, expected, TOLERANCE, f"{name} ({spelling})")


@pytest.mark.parametrize("name", HYBRID)
def test_mlx_lm_conversion_matches_mlx_lm(name):
    folder = GOLDEN / name / "mlx"
    expected = json.loads((folder / "expected.json").read_text())
    loaded = load_model(folder, dtype="float32")
    assert any(k.endswith(".scales") for k, _ in _flat(loaded.model.parameters())), "not quantized"
    ids, logprobs = greedy(loaded.model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert_matches(ids, logprobs, expected, MLX_TOLERANCE, f"{name} (mlx-lm 4-bit)")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "lfm2_moe"])
def test_chunked_prefill_equals_one_pass(name):
    model, expected = build(name)
    prompt = expected["prompt_ids"]
    whole = _prefill(model, prompt, len(prompt))
    for chunk in (3, 7, 64):
        logits, cache = _prefill(model, prompt, chunk)
        assert mx.allclose(logits, whole[0], atol=1e-4).item(), f"chunk {chunk}: logits differ"
        for a, b in zip(cache, whole[1]):
            if isinstance(a, RecurrentCache):
                assert a.offset == b.offset == len(prompt)
                for x, y in zip(a.arrays, b.arrays):
                    assert mx.allclose(x, y, atol=1e-5).item(), f"chunk {chunk}: recurrent state differs"
    ids, _ = greedy(model, prompt, len(expected["greedy_ids"]), chunk=7)
    assert ids == expected["greedy_ids"]


def _prefill(model, prompt, chunk):
    cache = model.make_cache()
    for start in range(0, len(prompt), chunk):
        logits = model(mx.array([prompt[start : start + chunk]]), cache=cache)[:, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits, cache


def _flat(params, prefix=""):
    if isinstance(params, dict):
        for k, v in params.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(params, list):
        for i, v in enumerate(params):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], params
