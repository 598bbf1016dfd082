"""Gemma 3 and Qwen2.5-VL image paths against transformers (tests/golden/make_vision_goldens.py).

The tiny checkpoints are complete model folders in transformers' own layout; the photo
is ../shared/data/images/chelsea.png. Compared: the tower + projector features, the
expanded prompt ids and where the image tokens sit, Qwen's 3-D positions, and greedy
ids with their log-probabilities (decode steps continue past the image correctly).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "vision"
FAMILIES = ["gemma3", "qwen2_5_vl"]


def expected(name: str) -> dict:
    return json.loads((GOLDEN / name / "expected.json").read_text())


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    host = ModelHost()
    host.load(str(GOLDEN / request.param))
    return request.param, host


def test_features_prompt_and_positions_match_transformers(loaded, shared_data):
    name, host = loaded
    exp = expected(name)
    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    item = host.towers.prepare([image])[0]
    features = np.array(host.towers.features(item))
    np.testing.assert_allclose(features, np.array(exp["features"]), atol=1e-4, rtol=0)

    chat = host.session("prompt")
    messages, items = split_media(exp["messages"], [image])
    prompt = chat.media_prompt(chat.render(messages), items)
    assert prompt.ids == exp["prompt_ids"]
    assert [j for s in prompt.spans for j in range(s.start, s.end)] == exp["image_positions"]
    if name == "qwen2_5_vl":
        positions = host.model.rope_index(prompt.ids, [(s.start, s.end, s.item.grid) for s in prompt.spans])
        assert positions.tolist() == exp["position_ids"]
        assert int(positions.max()) + 1 - len(prompt.ids) == exp["rope_delta"]


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_ids_and_logprobs_match_transformers(loaded, shared_data, chunk):
    """A chunk of 7 ends inside the image run; the prefill moves it off the image."""
    name, host = loaded
    exp = expected(name)
    path = str(shared_data / "images" / exp["image"])
    messages = [{"role": "user", "content": [{"type": "image", "image": path}, exp["messages"][0]["content"][1]]}]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk)
    result = host.generate(f"chunk{chunk}", messages, params)
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=2e-3, rtol=0)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])


def test_text_only_positions_are_plain_rope():
    """Qwen2.5-VL with three equal position ids is exactly its plain-RoPE path."""
    import mlx.core as mx

    host = ModelHost()
    host.load(str(GOLDEN / "qwen2_5_vl"))
    ids = mx.array([[1, 20, 30, 40, 50, 60, 70]])
    positions = mx.broadcast_to(mx.arange(7)[None, None], (3, 1, 7))
    np.testing.assert_allclose(
        np.array(host.model(ids, position_ids=positions)), np.array(host.model(ids)), atol=1e-4, rtol=0
    )


def test_compiled_decode_after_an_image_matches_transformers(loaded, shared_data, monkeypatch):
    """The compiled decode step (a GPU's default) serves the replies to image prompts too,
    Qwen2.5-VL's included, whose multimodal RoPE continues text at shifted positions."""
    import engine.decode.loop as generate
    from engine.decode.compiled_step import CompiledDecoder

    name, host = loaded
    exp = expected(name)
    plain_step = generate.generate_step
    monkeypatch.setattr(generate, "generate_step", lambda *a, **k: plain_step(*a, **{**k, "compiled": True}))
    steps = []
    real_call = CompiledDecoder.__call__

    def counted(self, tokens, cache, *shift):
        out = real_call(self, tokens, cache, *shift)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(CompiledDecoder, "__call__", counted)
    path = str(shared_data / "images" / exp["image"])
    messages = [{"role": "user", "content": [{"type": "image", "image": path}, exp["messages"][0]["content"][1]]}]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True)
    result = host.generate("compiled", messages, params)
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=2e-3, rtol=0)
    assert sum(steps) == len(exp["token_ids"]) - 1  # every step after the prompt's last token


def test_speculative_decoding_after_an_image_matches_transformers(loaded, shared_data):
    """n-gram drafts verified after an image: greedy output is transformers' own, also
    where multimodal RoPE shifts the verification passes' positions (Qwen2.5-VL)."""
    name, host = loaded
    exp = expected(name)
    path = str(shared_data / "images" / exp["image"])
    messages = [{"role": "user", "content": [{"type": "image", "image": path}, exp["messages"][0]["content"][1]]}]
    params = GenerationParams(
        max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, speculative="ngram", ngram_size=1
    )
    result = host.generate("speculative", messages, params)
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=2e-3, rtol=0)
    if name == "qwen2_5_vl":  # its reply repeats, so lookup finds drafts to verify
        assert result.stats.draft_tokens > 0
