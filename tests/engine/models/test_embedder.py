"""Sentence embedding models against sentence-transformers' own vectors
(tests/golden/make_embedding_goldens.py): Qwen3-Embedding's layout (Qwen3 backbone,
last-token pooling) and EmbeddingGemma's (Gemma 3 with bidirectional attention, mean
pooling, two Dense layers, in the published repos' older file spelling)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.artifacts.sentence_transformers import read_embedding_spec
from engine.errors import UnsupportedModelError, WrongModelKind
from engine.models.embedder import bidirectional_mask, pool
from engine.runtime.host import ModelHost

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "embeddings"
NAMES = ["qwen3_embedding", "embeddinggemma"]


def _cosine_gap(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(1 - a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def host():
    return ModelHost()


@pytest.mark.parametrize("name", NAMES)
def test_embeddings_match_sentence_transformers(host, name):
    expected = json.loads((GOLDEN / name / "expected.json").read_text())
    info = host.load(str(GOLDEN / name))
    assert info.embedding_dimensions == expected["dimensions"]
    result = host.embed(expected["texts"])
    for got, want in zip(result.vectors, expected["embeddings"], strict=True):
        assert _cosine_gap(got, want) < 1e-6
        assert np.allclose(got, want, atol=1e-5)  # the same vector, norm included
    # Tokens as sentence-transformers counts them: its special tokens, its truncation.
    assert result.prompt_tokens == sum(len(ids) for ids in expected["token_ids"])
    assert max(len(ids) for ids in expected["token_ids"]) == expected["max_seq_length"]
    # Token ids in, the same vectors out.
    again = host.embed(expected["token_ids"])
    for got, want in zip(again.vectors, result.vectors, strict=True):
        assert _cosine_gap(got, want) < 1e-9


def test_an_embedding_model_refuses_to_chat(host):
    host.load(str(GOLDEN / "qwen3_embedding"))
    with pytest.raises(WrongModelKind, match="embedding model.*cannot chat"):
        host.generate_ids([4, 5], None)


def test_bidirectional_attention_is_what_makes_embeddinggemma_right(host):
    """The same weights attending causally give another vector: the mask is not idle."""
    expected = json.loads((GOLDEN / "embeddinggemma" / "expected.json").read_text())
    host.load(str(GOLDEN / "embeddinggemma"))
    model = host.model
    model._make_mask = lambda n, cache, window: (
        "causal" if window is None else mx.arange(n)[None, :] <= mx.arange(n)[:, None]
    )
    causal = np.array(model(expected["token_ids"][1]))
    assert _cosine_gap(causal, expected["embeddings"][1]) > 1e-3


def test_bidirectional_window_is_half_the_stored_window_each_way():
    mask = np.array(bidirectional_mask(12, None, 8))
    assert mask[5, 1] and mask[5, 9] and not mask[5, 0] and not mask[5, 10]  # |d| <= 4
    assert bidirectional_mask(12, None, None) is None


def test_pooling_modes():
    h = mx.array([[1.0, 4.0], [3.0, 0.0], [2.0, 2.0]])
    assert np.allclose(pool("mean", h), [2.0, 2.0])
    assert np.allclose(pool("lasttoken", h), [2.0, 2.0]) and np.allclose(pool("cls", h), [1.0, 4.0])
    assert np.allclose(pool("max", h), [3.0, 4.0])
    assert np.allclose(pool("mean_sqrt_len_tokens", h), np.array([6.0, 6.0]) / np.sqrt(3))
    assert np.allclose(pool("weightedmean", h), np.array([1 + 6 + 6, 4 + 0 + 6]) / 6)


def test_both_pooling_spellings_read_alike(tmp_path):
    legacy = read_embedding_spec(GOLDEN / "embeddinggemma", 64)
    assert legacy.pooling == ("mean",) and legacy.normalize and legacy.max_seq_length == 24
    assert [(d.in_features, d.out_features, d.activation) for d in legacy.dense] == [
        (64, 96, "identity"),
        (96, 48, "identity"),
    ]
    newer = read_embedding_spec(GOLDEN / "qwen3_embedding", 64)
    assert newer.pooling == ("lasttoken",) and newer.normalize and newer.dense == () and newer.dimensions == 64
    assert newer.max_seq_length == 24  # from the tokenizer's model_max_length, where newer writers put it
    assert read_embedding_spec(GOLDEN.parent / "models" / "llama", 64) is None


def test_an_unknown_module_is_named(tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(GOLDEN / "qwen3_embedding", folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="'LayerNorm'.*supported: Transformer, Pooling, Dense, Normalize"):
        read_embedding_spec(folder, 64)


def test_a_family_that_does_not_embed_is_refused_naming_those_that_do(tmp_path):
    from engine.runtime.loading import load_model

    folder = tmp_path / "llama-embed"
    shutil.copytree(GOLDEN.parent / "models" / "llama", folder)
    shutil.copy(GOLDEN / "qwen3_embedding" / "modules.json", folder)
    shutil.copytree(GOLDEN / "qwen3_embedding" / "1_Pooling", folder / "1_Pooling")
    with pytest.raises(
        UnsupportedModelError, match=r"'llama'.*gemma3_text \(EmbeddingGemma\), qwen3 \(Qwen3-Embedding\)"
    ):
        load_model(folder)


def test_embeddinggemma_in_the_published_config_spelling(host, tmp_path):
    """The published config.json spells RoPE as rope_theta + rope_local_base_freq (transformers
    4.x) where transformers 5 writes rope_parameters: the same vectors either way."""
    folder = tmp_path / "embeddinggemma"
    shutil.copytree(GOLDEN / "embeddinggemma", folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    expected = json.loads((folder / "expected.json").read_text())
    host.load(str(folder))
    for got, want in zip(host.embed(expected["texts"]).vectors, expected["embeddings"], strict=True):
        assert _cosine_gap(got, want) < 1e-6
