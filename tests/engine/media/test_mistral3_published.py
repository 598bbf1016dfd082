"""Mistral 3 in the published repos' spelling (tests/golden/mistral3_published, written
from tests/golden/mistral3 by make_mistral3_published_golden.py, which checks with
transformers that both folders are one model): flat ``rope_theta`` in the text and
vision configs, ``torch_dtype``, the image processor in preprocessor_config.json.

Both folders must load to the same language model, tower, processor and weights, and
give transformers' reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput
from tests.engine.media.test_qwen3_vl import load_float32

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
SPELLINGS = {"transformers 5": GOLDEN / "mistral3", "published": GOLDEN / "mistral3_published"}


@pytest.fixture(scope="module")
def exp() -> dict:
    return json.loads((GOLDEN / "mistral3" / "expected.json").read_text())


@pytest.fixture(scope="module")
def hosts() -> dict:
    return {name: load_float32(folder) for name, folder in SPELLINGS.items()}


def test_the_published_folder_is_in_the_published_spelling():
    config = json.loads((SPELLINGS["published"] / "config.json").read_text())
    for part in ("text_config", "vision_config"):
        assert "rope_parameters" not in config[part] and "rope_theta" in config[part]
    assert "torch_dtype" in config and "dtype" not in config
    processor = json.loads((SPELLINGS["published"] / "processor_config.json").read_text())
    assert "image_processor" not in processor
    assert (SPELLINGS["published"] / "preprocessor_config.json").is_file()


def test_both_spellings_load_the_same_model_tower_and_processor(hosts, shared_data, exp):
    from mlx.utils import tree_flatten

    ours, published = hosts["transformers 5"], hosts["published"]
    assert ours.model.args == published.model.args
    a, b = dict(tree_flatten(ours.model.parameters())), dict(tree_flatten(published.model.parameters()))
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)

    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    encoders = [h.towers.encoder("image") for h in (ours, published)]
    assert encoders[0].config == encoders[1].config
    assert encoders[0].processor == encoders[1].processor
    settings = [(e.merge, e.text_hidden, e.eps, e.act, e.bias, e.feature_layers, e.token_id) for e in encoders]
    assert settings[0] == settings[1]
    towers = [dict(tree_flatten(e.load().parameters())) for e in encoders]
    assert towers[0].keys() == towers[1].keys()
    assert all(np.array_equal(np.array(towers[0][k]), np.array(towers[1][k])) for k in towers[0])
    items = [h.towers.prepare([image])[0] for h in (ours, published)]
    assert items[0].text == items[1].text
    assert np.array_equal(items[0].views[0].data[1], items[1].views[0].data[1])


def test_the_published_spelling_gives_transformers_reply(hosts, shared_data, exp):
    image = MediaInput("image", str(shared_data / "images" / exp["image"]))
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True)
    result = hosts["published"].generate("published", exp["messages"], params, media=[image])
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
