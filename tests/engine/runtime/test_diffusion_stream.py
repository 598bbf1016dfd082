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


def load(sliding_window: int | None = None):
    config = json.loads((GOLDEN / "config.json").read_text())
    if sliding_window is not None:
        config["text_config"]["sliding_window"] = sliding_window
    family = get_family(config["model_type"])
    m = family.Model(family.ModelArgs.from_dict(config))
    m.load_weights(list(m.sanitize(dict(mx.load(str(GOLDEN / "model.safetensors")))).items()))
    m.diffusion_settings = DiffusionSettings(steps=4)
    return m


@pytest.fixture(scope="module")
def model():
    return load()


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
    assert result.stats.prompt_tps > 0 and result.stats.prompt_tokens == 11
    assert (
        run(model, GenerationParams(max_tokens=20, sampling=SamplingParams(seed=5)))[-1].token_ids == result.token_ids
    )


def test_speculative_decoding_is_refused_in_one_line(model):
    with pytest.raises(EngineError, match="speculative decoding and draft models do not apply"):
        run(model, GenerationParams(max_tokens=8, speculative="ngram"))


def test_cancel_before_the_first_block_ends_it(model):
    cancel = threading.Event()
    cancel.set()
    result = run(model, GenerationParams(max_tokens=16), cancel)[-1]
    assert result.finish_reason == "cancelled" and result.token_ids == []


def test_a_session_picks_block_diffusion_by_family(model):
    from engine.runtime.session import ChatSession

    prompt = json.loads((GOLDEN / "diffusion.json").read_text())["prompt_ids"]
    session = ChatSession(model, None, eos_token_ids=[])
    params = GenerationParams(max_tokens=9, sampling=SamplingParams(seed=2))
    result = list(session.stream_ids(prompt, params))[-1]
    assert len(result.token_ids) == 16 and result.denoising_steps >= 2  # two whole blocks
    # The cache holds the prompt and the first block: transformers never encodes the last one.
    assert session.ids == prompt + result.token_ids[:8]
    assert list(session.stream_ids(prompt, params))[-1].token_ids == result.token_ids
    with pytest.raises(EngineError, match="do not apply"):
        list(session.stream_ids(prompt, GenerationParams(max_tokens=8, speculative="ngram")))


@pytest.mark.parametrize("window", [6, 64])
def test_follow_up_turns_prefill_only_their_new_tokens_and_write_what_a_fresh_cache_writes(window):
    """Three turns with an edit in the middle: each reuses the prefix it shares with what the
    cache holds (the prompt and every block but the last), and writes the ids a fresh
    session writes for the same prompt and seed. The golden's sliding window (6) has
    rotated past the edit, so that cache starts afresh; a wider one trims back to it."""
    from engine.runtime.session import ChatSession

    model = load(window)
    prompt = json.loads((GOLDEN / "diffusion.json").read_text())["prompt_ids"]
    params = GenerationParams(max_tokens=20, sampling=SamplingParams(seed=7))
    session = ChatSession(model, None, eos_token_ids=[])
    encoded: list[int] = []
    real_encode = model.encode

    def counting(inputs, cache, *args, **kwargs):
        encoded.append(inputs.shape[1])
        return real_encode(inputs, cache, *args, **kwargs)

    def turn(ids):
        encoded.clear()
        result = list(session.stream_ids(ids, params))[-1]
        fresh = list(ChatSession(model, None, eos_token_ids=[]).stream_ids(ids, params))[-1]
        assert result.token_ids == fresh.token_ids and result.denoising_steps == fresh.denoising_steps
        return result, encoded[0]  # the first encoder pass: the uncached prompt

    model.encode = counting
    try:
        first, fed = turn(prompt)
        assert fed == len(prompt) and first.stats.cached_tokens == 0
        follow = prompt + first.token_ids + [40, 41, 42]
        second, fed = turn(follow)
        held = len(prompt) + len(first.token_ids) - 8  # all but the last block
        assert second.stats.cached_tokens == held and fed == len(follow) - held
        assert second.stats.prompt_tokens == len(follow)
        edited = prompt[:5] + [77] + follow[6:]  # an edit inside the first prompt
        third, fed = turn(edited)
        kept = 5 if window > len(edited) else 0
        assert third.stats.cached_tokens == kept and fed == len(edited) - kept
    finally:
        model.encode = real_encode


def test_generate_cli_reads_the_denoising_settings_and_reports_the_steps(tmp_path, capsys):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.cli.main import main

    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / name, tmp_path / name)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t2", "eos_token": "t1", "pad_token": "t0"}
        )
    )
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"max_denoising_steps": 3, "stability_threshold": 0, "confidence_threshold": 1e-9, "eos_token_id": 1}
        )
    )
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path),
                "--prompt",
                "t5 t9 t33",
                "--max-tokens",
                "9",
                "--json",
                "--seed",
                "4",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["denoising_steps"] == 6  # two blocks, three steps each (never confident enough to stop)
    assert len(out["token_ids"]) == 16 or out["finish_reason"] == "stop"


def test_drafts_show_each_block_refining_then_its_settled_text(tmp_path, monkeypatch):
    from engine.decode import diffusion
    from engine.decode.diffusion import Draft
    from engine.runtime.loading import load_model
    from engine.text.tokenizer import Tokenizer
    from tests.tiny_diffusion_gemma import make_tiny_diffusion_gemma

    monkeypatch.setattr(diffusion, "DRAFT_INTERVAL_S", 0.0)  # every step, for the count below
    folder = make_tiny_diffusion_gemma(tmp_path / "dg", steps=5)
    model, tokenizer = load_model(folder).model, Tokenizer.from_dir(folder)
    prompt = tokenizer.encode("hello there")
    items = list(
        stream_diffusion(
            model, tokenizer, prompt, None, GenerationParams(max_tokens=24, sampling=SamplingParams(seed=1))
        )
    )
    result = items[-1]
    blocks: list[list[Draft]] = [[]]
    settled = []
    for item in items[:-1]:
        if isinstance(item, Draft):
            blocks[-1].append(item)
        elif item.token_ids:
            settled.append(item.text)
            blocks.append([])
    blocks = blocks[: len(settled)]
    assert len(settled) >= 2 and result.denoising_steps == 5 * len(settled)
    for drafts, text in zip(blocks, settled):
        assert [d.step for d in drafts] == [1, 2, 3, 4, 5] and {d.steps for d in drafts} == {5}
        assert drafts[-1].text == text  # the last step's canvas is the block
    assert any(len({d.text for d in drafts}) > 1 for drafts in blocks)  # the canvas changed as it refined
    # Throttled (the default), a block is still shown after its first step.
    monkeypatch.setattr(diffusion, "DRAFT_INTERVAL_S", 3600.0)
    again = list(
        stream_diffusion(
            model, tokenizer, prompt, None, GenerationParams(max_tokens=24, sampling=SamplingParams(seed=1))
        )
    )
    assert [d.step for d in again if isinstance(d, Draft)] == [1] * len(settled)
    assert again[-1].token_ids == result.token_ids


def test_the_steps_are_reported_block_by_block_as_transformers_took_them(monkeypatch):
    """Fed transformers' own random draws (tests/golden/diffusion_gemma, float32 as they
    were made), the reply's blocks took the steps transformers' generation took."""
    from engine.decode import diffusion
    from tests.engine.models.test_diffusion_gemma import load as load_float32
    from tests.engine.models.test_diffusion_gemma import replay, settings_of

    model, expected, _ = load_float32(GOLDEN.name)
    monkeypatch.setattr(diffusion, "RandomNoise", lambda seed: replay(expected))
    result = list(
        stream_diffusion(
            model,
            None,
            expected["prompt_ids"],
            None,
            GenerationParams(max_tokens=expected["generation"]["max_new_tokens"]),
            eos_token_ids=[1],
            settings=settings_of(expected),
        )
    )[-1]
    assert result.denoising_steps_per_block == expected["steps_per_block"] == [3, 2]
    assert result.denoising_steps == 5


def test_generate_json_reports_the_steps_of_each_block(tmp_path, capsys):
    """The CLI's --json: one entry per block (three blocks of 8 for 24 tokens), summing to
    the total; under the golden's early-stop settings the blocks need not all take the most."""
    from engine.cli.main import main
    from tests.tiny_diffusion_gemma import make_tiny_diffusion_gemma

    folder = make_tiny_diffusion_gemma(tmp_path / "dg")
    g = json.loads((GOLDEN / "diffusion.json").read_text())["generation"]
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(
        {k: g[k] for k in ("max_denoising_steps", "t_min", "t_max", "confidence_threshold", "stability_threshold")}
    )
    (folder / "generation_config.json").write_text(json.dumps(config))
    argv = ["generate", "--model", str(folder), "--prompt", "hello there", "--max-tokens", "24"]
    assert main([*argv, "--ignore-eos", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    per_block = out["denoising_steps_per_block"]
    assert len(per_block) == 3 and len(out["token_ids"]) == 24
    assert sum(per_block) == out["denoising_steps"] and all(1 <= s <= g["max_denoising_steps"] for s in per_block)
    assert min(per_block) < g["max_denoising_steps"]  # an early stop: not the most times the blocks


def _drafts_and_pieces(items):
    """Drafts grouped by the block they refine, and each block's settled pieces."""
    drafts: list[list] = [[]]
    settled: list[list[Piece]] = [[]]
    for item in items[:-1]:
        if isinstance(item, Piece):
            settled[-1].append(item)
        else:
            if settled[-1]:  # a draft after settled text: the next block refining
                drafts.append([])
                settled.append([])
            drafts[-1].append(item)
    return drafts, settled


def test_drafts_go_through_the_reasoning_split_as_settled_text_does(tmp_path, monkeypatch):
    """A template that thinks: the refining canvas never shows the markers. The close marker
    here is text the tiny model writes in its first block, so the block's drafts really hold
    it: the last draft splits as the settled block does, thinking before it, answer after."""
    from engine.decode import diffusion
    from engine.runtime.loading import load_model
    from engine.text.markers import ReasoningSplitter
    from engine.text.tokenizer import Tokenizer
    from tests.tiny_diffusion_gemma import make_tiny_diffusion_gemma

    monkeypatch.setattr(diffusion, "DRAFT_INTERVAL_S", 0.0)
    folder = make_tiny_diffusion_gemma(tmp_path / "dg", steps=5)
    model, tokenizer = load_model(folder).model, Tokenizer.from_dir(folder)
    prompt = tokenizer.encode("hello there")
    params = GenerationParams(max_tokens=16, sampling=SamplingParams(seed=1))

    def run(reasoning=None):
        return list(stream_diffusion(model, tokenizer, prompt, None, params, reasoning=reasoning))

    raw = [d.text for d in _drafts_and_pieces(run())[0][0]]  # the first block's canvases, unsplit
    first_block = raw[-1]
    # Two characters of the settled block that its first canvas lacks: drafts without and with it.
    close = next(first_block[i : i + 2] for i in range(1, len(first_block) - 2) if first_block[i : i + 2] not in raw[0])
    assert "\n" not in close and close.strip()
    at = first_block.index(close)
    items = run(ReasoningSplitter("<never-opened>", close, starts_in_reasoning=True))
    drafts, settled = _drafts_and_pieces(items)
    assert len(drafts[0]) == len(raw) == 5
    for text, draft in zip(raw, drafts[0]):  # the same draws: the same canvases, now split
        if close in text:
            i = text.index(close)
            assert (draft.reasoning, draft.text) == (text[:i], text[i + len(close) :].lstrip("\n"))
        else:  # still thinking (a last character that may begin the marker is held back)
            assert draft.text == "" and text.startswith(draft.reasoning) and len(text) - len(draft.reasoning) <= 1
    assert any(close not in text for text in raw) and any(close in text for text in raw)
    last = drafts[0][-1]
    assert (last.reasoning, last.text) == (first_block[:at], first_block[at + 2 :].lstrip("\n"))
    by_channel = {c: "".join(p.text for p in settled[0] if p.channel == c) for c in ("reasoning", "answer")}
    assert by_channel == {"reasoning": last.reasoning, "answer": last.text}
    assert items[-1].reasoning == first_block[:at]
