"""Mistral 3 images (Pixtral tower, patch merger, projector) against transformers 5.23
(tests/golden/make_mistral3_goldens.py).

The tiny checkpoint's language model is a plain ``mistral`` model (sliding window
shorter than the prompt); it is bf16 on disk and loaded in float32, as the reference
ran. Compared on ../shared/data/images/chelsea.png: the processor's pixel values (bit
for bit), the tower + projector features, the prompt as PixtralProcessor expands it
(rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END]), greedy ids and log-probs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "mistral3"


@pytest.fixture(scope="module")
def exp() -> dict:
    return json.loads((GOLDEN / "expected.json").read_text())


@pytest.fixture(scope="module")
def host() -> ModelHost:
    from engine.runtime import loading as loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        host = ModelHost()
        host.load(str(GOLDEN))
    return host


def test_pixels_features_and_prompt_match_transformers(host, exp, shared_data):
    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    item = host.towers.prepare([image])[0]
    assert not host.tower_loaded  # preparing reads no weights
    pixels = item.views[0].data[1]
    assert list(pixels.shape) == exp["pixels"]["shape"]
    assert list(pixels.shape[1:]) == exp["image_size"]
    assert (
        hashlib.sha256(np.ascontiguousarray(pixels, dtype=np.float32).tobytes()).hexdigest() == exp["pixels"]["sha256"]
    )
    features = np.concatenate([np.array(host.towers.features(row)) for row in item.views])
    np.testing.assert_allclose(features, np.array(exp["features"]), atol=1e-4, rtol=0)

    chat = host.session("prompt")
    messages, items = split_media(exp["messages"], [image])
    prompt = chat.media_prompt(chat.render(messages), items)
    assert prompt.ids == exp["prompt_ids"]
    assert sum(s.end - s.start for s in prompt.spans) == len(exp["features"])


@pytest.mark.parametrize("chunk", [512, 5])
def test_greedy_ids_and_logprobs_match_transformers(host, exp, shared_data, chunk):
    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk)
    result = host.generate(f"chunk{chunk}", exp["messages"], params, media=[image])
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])


def test_the_image_is_encoded_once_for_all_its_rows(shared_data, exp, monkeypatch):
    from engine.media.pixtral.tower import Mistral3Vision
    from engine.runtime import loading as loader

    forwards = []
    real = Mistral3Vision.__call__
    monkeypatch.setattr(Mistral3Vision, "__call__", lambda self, pixels: forwards.append(1) or real(self, pixels))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        host = ModelHost()
        host.load(str(GOLDEN))
    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    host.generate("a", exp["messages"], GenerationParams(max_tokens=1), media=[image])
    encoder = host.towers.encoder("image")
    runs = encoder.calls
    assert runs == exp["image_size"][0] // 16  # one run of [IMG] per row of merge blocks
    host.generate("b", exp["messages"], GenerationParams(max_tokens=1), media=[image])
    assert encoder.calls == runs  # the rows come from the encoded-media cache
    assert len(forwards) == 1  # one pass of the tower served every row


def test_a_mistral3_with_another_language_model_is_refused_in_one_line(tmp_path):
    from engine.errors import UnsupportedModelError
    from engine.models import get_family

    config = json.loads((GOLDEN / "config.json").read_text())
    config["text_config"]["model_type"] = "gemma3_text"
    family = get_family("mistral3")
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        family.ModelArgs.from_dict(config)
