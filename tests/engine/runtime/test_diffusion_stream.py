"""Block diffusion as the session streams it: pieces block by block, the
steps reported, speculative decoding refused in one line, cancellation honoured."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import GenerationParams, GenerationResult, SamplingParams
from engine.decode.diffusion import DiffusionSettings, stream_diffusion
from engine.decode.loop import Piece
from engine.errors import EngineError
from engine.models import get_family

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "diffusion_gemma" / "diffusion_gemma_tiny"


@pytest.fixture(scope="module")
def model():
    config = json.loads((GOLDEN / "config.json").read_text())
    family = get_family(config["model_type"])
    m = family.Model(family.ModelArgs.from_dict(config))
    m.load_weights(list(m.sanitize(dict(mx.load(str(GOLDEN / "model.safetensors")))).items()))
    m.diffusion_settings = DiffusionSettings(steps=4)
    return m


def run(model, params, cancel=None):
    prompt = json.loads((GOLDEN / "diffusion.json").read_text())["prompt_ids"]
    return list(stream_diffusion(model, None, prompt, None, params, cancel=cancel, eos_token_ids=[]))


def test_pieces_come_block_by_block_with_the_steps_counted(model):
    items = run(model, GenerationParams(max_tokens=20, sampling=SamplingParams(seed=5)))
    pieces, result = [i for i in items if isinstance(i, Piece)], items[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "length"
    assert [len(p.token_ids) for p in pieces] == [8, 8, 8]  # whole blocks, as transformers writes them
    assert [t for p in pieces for t in p.token_ids] == result.token_ids
    assert 3 <= result.denoising_steps <= 12 and result.stats.generated_tokens == 24
    assert run(model, GenerationParams(max_tokens=20, sampling=SamplingParams(seed=5)))[-1].token_ids == result.token_ids


def test_speculative_decoding_is_refused_in_one_line(model):
    with pytest.raises(EngineError, match="speculative decoding and draft models do not apply"):
        run(model, GenerationParams(max_tokens=8, speculative="ngram"))


def test_cancel_before_the_first_block_ends_it(model):
    cancel = threading.Event()
    cancel.set()
    result = run(model, GenerationParams(max_tokens=16), cancel)[-1]
    assert result.finish_reason == "cancelled" and result.token_ids == []


def test_a_session_picks_block_diffusion_by_family_and_keeps_no_stale_cache(model):
    from engine.runtime.session import ChatSession

    prompt = json.loads((GOLDEN / "diffusion.json").read_text())["prompt_ids"]
    session = ChatSession(model, None, eos_token_ids=[])
    params = GenerationParams(max_tokens=9, sampling=SamplingParams(seed=2))
    items = list(session.stream_ids(prompt, params))
    result = items[-1]
    assert len(result.token_ids) == 16 and result.denoising_steps >= 2  # two whole blocks
    assert session.cache is None and session.ids == []  # the next turn starts afresh
    assert list(session.stream_ids(prompt, params))[-1].token_ids == result.token_ids
    with pytest.raises(EngineError, match="do not apply"):
        list(session.stream_ids(prompt, GenerationParams(max_tokens=8, speculative="ngram")))
