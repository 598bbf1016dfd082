"""Speculative decoding for prompts with images and audio.

Referees: transformers' greedy ids for the tiny golden Gemma 3 with its sliding window
widened to 512 (tests/golden/make_spec_media_goldens.py; a 6-token window rotates past the
prompt and cannot be rewound, which turns drafting off), and for the tiny golden Voxtral
on ../shared/data/audio/jfk.wav (tests/golden/make_voxtral_goldens.py). Drafting must
never change greedy output; drafts must actually be made and counted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from spec_models import make_llama

from engine.api import GenerationParams
from engine.runtime.host import ModelHost

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
GEMMA = GOLDEN / "vision" / "gemma3"
WIDE = json.loads((GOLDEN / "media" / "gemma3_wide_window.json").read_text())
GEMMA_EXPECTED = json.loads((GEMMA / "expected.json").read_text())
VOXTRAL = GOLDEN / "voxtral_tiny"
VOXTRAL_META = json.loads((GOLDEN / "media" / "voxtral_tiny.json").read_text())
QUESTION = "What is in this picture?"


def ask(kind: str, path: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": kind, kind: path}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def wide_gemma(tmp_path_factory) -> Path:
    """The golden Gemma 3 folder with the window the wide-window golden was made with."""
    folder = tmp_path_factory.mktemp("gemma3-wide") / "gemma3"
    shutil.copytree(GEMMA, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sliding_window"] = WIDE["sliding_window"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def gemma(wide_gemma) -> ModelHost:
    host = ModelHost()
    host.load(str(wide_gemma))
    host.load_draft(str(wide_gemma))  # the model drafting for itself, blind to the image
    return host


@pytest.fixture(scope="module")
def photo(shared_data) -> str:
    return str(shared_data / "images" / WIDE["image"])


def params(**kw) -> GenerationParams:
    # A fixed depth: these tests check verification with media, not when drafting pays.
    return GenerationParams(
        **{"max_tokens": len(WIDE["token_ids"]), "ignore_eos": True, "ngram_size": 2, "num_draft_tokens": 4, **kw}
    )


def test_plain_decoding_of_the_wide_window_gemma_matches_transformers(gemma, photo):
    result = gemma.generate("plain", ask("image", photo), params())
    assert result.token_ids == WIDE["token_ids"]
    assert result.stats.draft_tokens == 0


@pytest.mark.parametrize("chunk", [512, 11, 3])
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_gemma_image_speculative_greedy_matches_transformers(gemma, photo, mode, chunk):
    """Chunks of 11 and 3 end inside the image run: the prefill moves the end back to the
    image's start, or (when the image starts the chunk) forward to its end."""
    first, last = GEMMA_EXPECTED["image_positions"][0], GEMMA_EXPECTED["image_positions"][-1]
    if chunk < 512:
        assert any(first < k < last + 1 for k in range(chunk, last + 1, chunk))
    result = gemma.generate(f"{mode}{chunk}", ask("image", photo), params(speculative=mode, prefill_chunk=chunk))
    assert result.token_ids == WIDE["token_ids"]
    assert result.stats.draft_tokens > 0
    assert 0 < result.stats.accepted_draft_tokens <= result.stats.draft_tokens
    assert result.stats.prompt_tokens == len(WIDE["prompt_ids"])


def test_the_draft_model_does_not_see_the_image(gemma, photo):
    """Drafting for itself from the placeholder ids, the model guesses differently from the
    target that sees the photo: some drafts are rejected, and the output is still exact."""
    result = gemma.generate("blind", ask("image", photo), params(speculative="draft"))
    assert result.token_ids == WIDE["token_ids"]
    assert result.stats.accepted_draft_tokens < result.stats.draft_tokens


def test_narrow_window_gemma_falls_back_to_plain_and_matches_transformers(photo):
    """The golden's 6-token window has rotated past the prompt: nothing can be rewound, so
    no drafts are made, and the reply is transformers' all the same."""
    host = ModelHost()
    host.load(str(GEMMA))
    n = len(GEMMA_EXPECTED["token_ids"])
    result = host.generate(
        "a", ask("image", photo), GenerationParams(max_tokens=n, ignore_eos=True, speculative="ngram")
    )
    assert result.token_ids == GEMMA_EXPECTED["token_ids"]
    assert result.stats.draft_tokens == 0


def test_prefix_reuse_across_turns_with_the_same_image_and_a_swapped_one(gemma, wide_gemma, shared_data, photo):
    spec = params(speculative="draft", max_tokens=8)
    first = gemma.generate("turns", ask("image", photo), spec)
    follow = ask("image", photo) + [{"role": "assistant", "content": "a cat"}, {"role": "user", "content": "and?"}]
    second = gemma.generate("turns", follow, spec)
    image_end = GEMMA_EXPECTED["image_positions"][-1] + 1
    assert second.stats.cached_tokens > image_end  # the image's keys and values were reused
    assert second.stats.draft_tokens > 0
    chat = gemma.session("turns")
    assert len(chat._draft_ids) > image_end  # so was the draft model's cache
    swapped = ask("image", str(shared_data / "images" / "coffee.png")) + follow[1:]
    third = gemma.generate("turns", swapped, spec)
    assert third.stats.cached_tokens <= GEMMA_EXPECTED["image_positions"][0]  # another photo: no reuse past it

    reference = ModelHost()
    reference.load(str(wide_gemma))
    assert first.token_ids == WIDE["token_ids"][:8]
    assert second.token_ids == reference.generate("r1", follow, params(max_tokens=8)).token_ids
    assert third.token_ids == reference.generate("r2", swapped, params(max_tokens=8)).token_ids


# ---- audio ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def voxtral() -> ModelHost:
    host = ModelHost()
    host.load(str(VOXTRAL))
    return host


@pytest.fixture(scope="module")
def voxtral_gold() -> list[int]:
    with np.load(GOLDEN / "media" / "voxtral_tiny.npz") as z:
        return z["greedy/ids"].tolist()


def voxtral_params(**kw) -> GenerationParams:
    # A fixed depth, as in params(): the adaptive one would not pay a self-draft's prefill of
    # the whole prompt within so short a reply.
    return GenerationParams(
        **{"max_tokens": VOXTRAL_META["steps"], "ignore_eos": True, "ngram_size": 1, "num_draft_tokens": 4, **kw}
    )


def test_voxtral_audio_ngram_and_self_draft_match_transformers(voxtral, voxtral_gold, shared_data):
    clip = str(shared_data / "audio" / "jfk.wav")
    question = VOXTRAL_META["messages"][0]["content"][1]["text"]
    ngram = voxtral.generate("n", ask("audio", clip, question), voxtral_params(speculative="ngram"))
    assert ngram.token_ids == voxtral_gold and ngram.stats.draft_tokens > 0
    voxtral.load_draft(str(VOXTRAL))
    try:
        drafted = voxtral.generate(
            "d", ask("audio", clip, question), voxtral_params(speculative="draft", prefill_chunk=100)
        )
    finally:
        voxtral.load_draft(None)
    assert drafted.token_ids == voxtral_gold and drafted.stats.draft_tokens > 0


@pytest.mark.parametrize("vocab", [160, 20])
def test_voxtral_with_another_tiny_draft_model(voxtral, voxtral_gold, shared_data, vocab):
    """A random Llama drafts from the prompt's ids, the 375 [AUDIO] placeholders (id 24)
    among them. With 20 embedding rows the placeholders lie past its table and are fed as
    id 0 instead of being read from outside it."""
    assert (VOXTRAL_META["config"]["audio_token_id"] >= vocab) == (vocab == 20)
    clip = str(shared_data / "audio" / "jfk.wav")
    question = VOXTRAL_META["messages"][0]["content"][1]["text"]
    chat = voxtral.session(f"other{vocab}")
    chat.draft_model = make_llama(3, vocab=vocab, hidden=32)
    result = chat.generate(ask("audio", clip, question), voxtral_params(speculative="draft", num_draft_tokens=2))
    assert result.token_ids == voxtral_gold
    assert result.stats.draft_tokens > 0


def test_qwen2_5_vl_images_draft_and_match_transformers(photo):
    """Multimodal RoPE shifts the reply's positions; verification passes follow the shift."""
    folder = GOLDEN / "vision" / "qwen2_5_vl"
    exp = json.loads((folder / "expected.json").read_text())
    host = ModelHost()
    host.load(str(folder))
    host.load_draft(str(folder))
    for mode in ("ngram", "draft"):
        result = host.generate(
            mode,
            ask("image", photo),
            GenerationParams(max_tokens=len(exp["token_ids"]), ignore_eos=True, speculative=mode, num_draft_tokens=4),
        )
        assert result.token_ids == exp["token_ids"]
        assert result.stats.draft_tokens > 0


@pytest.mark.parametrize("drafting", ["ngram", "draft"])
def test_a_prompt_ending_inside_the_audio_run_feeds_its_last_feature(voxtral, shared_data, drafting):
    """The first pass feeds the prompt's last id; when that id is an [AUDIO] placeholder its
    input is the audio feature, as in plain decoding."""
    import mlx.core as mx

    from engine.api import MediaInput
    from engine.decode.drafters import DraftModelDrafter, NgramDrafter
    from engine.decode.loop import generate_step
    from engine.decode.speculative import speculative_step
    from engine.models.kv_cache import make_prompt_cache

    chat = voxtral.session("cut")
    template = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    media = chat.media_prompt(chat.render(template), [MediaInput("audio", str(shared_data / "audio" / "jfk.wav"))])
    inputs = chat._prompt_inputs(media, 0)
    cut = media.spans[0].start + 40  # the prompt ends on an audio token
    inputs.embeddings = inputs.embeddings[:cut]
    ids = media.ids[:cut]
    model = voxtral.model
    want = [
        t
        for t, _ in generate_step(
            mx.array(ids, dtype=mx.uint32), model, make_prompt_cache(model), max_tokens=10, inputs=inputs
        )
    ]
    drafter = NgramDrafter(1, 3) if drafting == "ngram" else DraftModelDrafter(model)
    got = [
        t
        for t, _ in speculative_step(
            ids, model, make_prompt_cache(model), drafter, max_tokens=10, inputs=inputs, prefill_chunk=16
        )
    ]
    assert got == want
