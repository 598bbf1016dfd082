"""The decode loop against a tiny model defined in tinymodel.py: greedy ids match a
full recomputation without cache, log-probs match log-softmax, stop conditions."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from engine.api import GenerationParams, GenerationResult, SamplingParams
from engine.decode.loop import Piece, StopStrings, generate, generate_step, stream_generate

from .tinymodel import ByteTokenizer, TinyLM

PROMPT = [5, 9, 17, 3, 22, 41, 8]


def _reference_greedy(model: TinyLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding recomputing the whole sequence each step (no cache)."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        tok = int(mx.argmax(logits).item())
        ids.append(tok)
        lps.append(float(lp[tok].item()))
    return ids[len(prompt) :], lps


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(vocab=64, dim=32, seed=1)


def _params(**kw) -> GenerationParams:
    kw.setdefault("ignore_eos", True)
    return GenerationParams(**kw)


@pytest.mark.parametrize("chunk", [1, 3, 512])
def test_greedy_matches_uncached_recomputation(model, chunk):
    ref_ids, ref_lps = _reference_greedy(model, PROMPT, 12)
    res = generate(
        model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=12, logprobs=True, prefill_chunk=chunk)
    )
    assert res.token_ids == ref_ids
    np.testing.assert_allclose(res.token_logprobs, ref_lps, atol=1e-4)
    assert res.finish_reason == "length"
    assert res.text == ByteTokenizer().decode(ref_ids)
    assert res.stats.prompt_tokens == len(PROMPT) and res.stats.generated_tokens == 12
    assert res.stats.peak_memory_bytes > 0 and res.stats.time_to_first_token > 0


def test_chunked_prefill_reports_progress_and_feeds_chunks(model):
    model.calls.clear()
    seen = []
    prompt = list(range(1, 12))
    gen = generate_step(
        mx.array(prompt),
        model,
        model.make_cache(),
        max_tokens=2,
        prefill_chunk=4,
        on_progress=lambda d, t: seen.append((d, t)),
    )
    assert len(list(gen)) == 2
    assert seen == [(4, 10), (8, 10), (10, 10)]
    assert model.calls == [4, 4, 2, 1, 1]  # prefill chunks, the last prompt token, one decode step


def test_eos_stops_unless_ignored(model):
    ref_ids, _ = _reference_greedy(model, PROMPT, 8)
    eos = ref_ids[4]
    first = ref_ids.index(eos)
    res = generate(
        model, ByteTokenizer(), PROMPT, model.make_cache(), GenerationParams(max_tokens=8), eos_token_ids=[eos]
    )
    assert res.finish_reason == "stop"
    assert res.token_ids == ref_ids[: first + 1]
    assert res.text == ByteTokenizer().decode(ref_ids[:first])  # the EOS token shows no text
    res = generate(model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=8), eos_token_ids=[eos])
    assert res.token_ids == ref_ids and res.finish_reason == "length"


def test_stop_string_split_across_tokens_is_trimmed_and_never_streamed(model):
    ref_ids, _ = _reference_greedy(model, PROMPT, 12)
    full = ByteTokenizer().decode(ref_ids)
    stop = full[4:7]
    assert full.find(stop) == 4
    items = list(
        stream_generate(
            model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=12, stop_strings=["\x7f\x7f", stop])
        )
    )
    pieces = [i for i in items if isinstance(i, Piece)]
    result = items[-1]
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "stop"
    assert result.text == full[:4] == "".join(p.text for p in pieces)
    assert len(result.token_ids) == 7  # stopped on the token completing the stop string


def test_held_back_text_is_released_when_no_stop_completes(model):
    ref_ids, _ = _reference_greedy(model, PROMPT, 6)
    full = ByteTokenizer().decode(ref_ids)
    res = generate(
        model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=6, stop_strings=[full[-2:] + "\x7f"])
    )
    assert res.text == full and res.finish_reason == "length"


def test_stop_strings_unit():
    s = StopStrings(["</end>", "xyz"])
    assert s.push("hello </") == ("hello ", False)
    assert s.push("en") == ("", False)
    assert s.push("x") == ("</en", False)  # "</enx" is no stop prefix, but "x" starts "xyz"
    assert s.push("y") == ("", False)
    assert s.push("zq") == ("", True)
    t = StopStrings([])
    assert t.push("abc") == ("abc", False)


def test_cancel_mid_decode(model):
    cancel = threading.Event()
    out = []
    for item in stream_generate(
        model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=50), cancel=cancel
    ):
        out.append(item)
        if len(out) == 3:
            cancel.set()
    result = out[-1]
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) == 3


def test_cancel_before_prefill(model):
    cancel = threading.Event()
    cancel.set()
    res = generate(model, ByteTokenizer(), PROMPT, model.make_cache(), _params(max_tokens=5), cancel=cancel)
    assert res.finish_reason == "cancelled" and res.token_ids == []


def test_seeded_sampling_reproducible_through_the_loop(model):
    p = _params(max_tokens=10, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    a = generate(model, ByteTokenizer(), PROMPT, model.make_cache(), p)
    b = generate(model, ByteTokenizer(), PROMPT, model.make_cache(), p)
    assert a.token_ids == b.token_ids


def test_repetition_penalty_changes_greedy_output(model):
    plain = generate(model, None, PROMPT, model.make_cache(), _params(max_tokens=16))
    pen = generate(
        model,
        None,
        PROMPT,
        model.make_cache(),
        _params(max_tokens=16, sampling=SamplingParams(repetition_penalty=5.0, repetition_context=64)),
    )
    # With a strong penalty nothing repeats within the window while fresh tokens remain.
    assert len(set(pen.token_ids)) == 16
    assert plain.token_ids != pen.token_ids


def test_cached_prompt_continues_identically(model):
    cache = model.make_cache()
    model(mx.array([PROMPT[:4]]), cache=cache)
    res = generate(model, None, PROMPT[4:], cache, _params(max_tokens=6), cached_tokens=4)
    ref_ids, _ = _reference_greedy(model, PROMPT, 6)
    assert res.token_ids == ref_ids
    assert res.stats.cached_tokens == 4 and res.stats.prompt_tokens == len(PROMPT)
