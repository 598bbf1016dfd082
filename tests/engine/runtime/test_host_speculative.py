"""Speculative decoding through ModelHost and ChatSession: greedy output identical to plain
decoding, with prefix reuse, adapters, and a draft model whose cache is reused too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.errors import EngineError
from engine.runtime.host import ModelHost

TURN1 = [{"role": "user", "content": "hello how are you"}]
PLAIN = GenerationParams(max_tokens=24, ignore_eos=True)
NGRAM = replace(PLAIN, speculative="ngram", ngram_size=2, num_draft_tokens=3)
DRAFT = replace(PLAIN, speculative="draft", num_draft_tokens=3)
# Text that repeats itself, so n-gram lookup has something to find.
REPEAT = "Once upon a time there was a little robot. Once upon a time there was a little robot. Once upon"


def turn2(reply: str) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and you today"}]


@pytest.fixture()
def host(tiny_model_dir):
    h = ModelHost()
    h.load(str(tiny_model_dir))
    return h


def plain(host: ModelHost, messages) -> list[int]:
    host.drop_session("plain")
    return host.generate("plain", messages, PLAIN).token_ids


def check_stats(stats) -> None:
    assert stats.draft_tokens > 0
    assert 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    assert stats.acceptance_rate == stats.accepted_draft_tokens / stats.draft_tokens


def test_ngram_greedy_equals_plain_with_prefix_reuse(host):
    ids = host.encode_prompt(REPEAT)
    want = host.generate_ids(ids, PLAIN, session_id="p").token_ids
    got = host.generate_ids(ids, NGRAM, session_id="s")
    assert got.token_ids == want
    check_stats(got.stats)  # random weights seldom continue the passage: few drafts accepted

    first = host.generate("chat", TURN1, NGRAM)
    assert first.token_ids == plain(host, TURN1)
    second = host.generate("chat", turn2(first.text), NGRAM)
    assert second.stats.cached_tokens > 0
    assert second.token_ids == plain(host, turn2(first.text))


def test_ngram_stops_at_eos_and_stop_strings_like_plain(host):
    ids = host.encode_prompt(REPEAT)
    for params in (replace(PLAIN, ignore_eos=False, max_tokens=40), replace(PLAIN, stop_strings=["e"])):
        want = host.generate_ids(ids, params, session_id="p")
        got = host.generate_ids(ids, replace(params, speculative="ngram", ngram_size=2), session_id="s")
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        # The session recorded what its cache holds: the next turn reuses it and still agrees.
        again = host.generate_ids(ids + [5, 6], replace(params, speculative="ngram"), session_id="s")
        assert again.stats.cached_tokens > 0
        assert again.token_ids == host.generate_ids(ids + [5, 6], params, session_id="q").token_ids


def test_draft_model_greedy_equals_plain_and_its_cache_is_reused(host, tiny_draft_dir):
    with pytest.raises(EngineError, match="needs one loaded"):
        host.generate("chat", TURN1, DRAFT)
    info = host.load_draft(str(tiny_draft_dir))
    assert info is not None and host.info.draft_model == info.path

    first = host.generate("chat", TURN1, DRAFT)
    assert first.token_ids == plain(host, TURN1)
    check_stats(first.stats)
    chat = host.session("chat")
    drafted = chat.draft_cache[0].offset
    assert drafted > 0 and len(chat._draft_ids) == drafted
    draft_cache = chat.draft_cache

    second = host.generate("chat", turn2(first.text), DRAFT)
    assert second.stats.cached_tokens > 0
    assert chat.draft_cache is draft_cache  # the draft's prefix was kept, not rebuilt
    assert second.token_ids == plain(host, turn2(first.text))
    check_stats(second.stats)

    host.load_draft(None)
    assert host.info.draft_model is None and chat.draft_model is None
    with pytest.raises(EngineError, match="needs one loaded"):
        host.generate("chat", TURN1, DRAFT)


def test_self_draft_accepts_everything(host, tiny_model_dir):
    host.load_draft(str(tiny_model_dir))  # the model drafting for itself: the upper bound
    result = host.generate("chat", TURN1, DRAFT)
    assert result.token_ids == plain(host, TURN1)
    assert result.stats.acceptance_rate == 1.0


def test_speculative_under_an_adapter(host, tiny_draft_dir, tiny_adapter_dirs):
    host.mount_adapter(str(tiny_adapter_dirs["alpha"]))
    host.load_draft(str(tiny_draft_dir))
    first = host.generate("chat", TURN1, DRAFT)
    host.set_active_adapters({"alpha": 1.0})
    want = plain(host, turn2(first.text))
    for params in (DRAFT, NGRAM):
        host.drop_session("chat")
        host.generate("chat", TURN1, replace(PLAIN, max_tokens=1))  # fills the cache under the adapter
        got = host.generate("chat", turn2(first.text), params)
        assert got.stats.cached_tokens > 0 and got.adapters == {"alpha": 1.0}
        assert got.token_ids == want
    host.set_active_adapters({})  # the draft's cache stays valid; the target's is rebuilt
    got = host.generate("chat", turn2(first.text), DRAFT)
    assert got.stats.cached_tokens == 0 and got.token_ids == plain(host, turn2(first.text))


def test_sampled_speculative_is_reproducible_with_a_seed(host, tiny_draft_dir):
    host.load_draft(str(tiny_draft_dir))
    params = replace(DRAFT, sampling=SamplingParams(temperature=0.8, top_k=40, seed=3))
    a = host.generate("a", TURN1, params)
    b = host.generate("b", TURN1, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    check_stats(a.stats)


def test_cancel_mid_draft_leaves_a_reusable_cache(host, tiny_draft_dir):
    import threading

    from engine.api import TokenEvent

    host.load_draft(str(tiny_draft_dir))
    cancel = threading.Event()
    seen: list[int] = []

    def on_event(event) -> None:
        if isinstance(event, TokenEvent):
            seen.extend(event.token_ids)
            if len(seen) >= 5:
                cancel.set()

    stopped = host.generate("chat", TURN1, DRAFT, on_event, cancel)
    assert stopped.finish_reason == "cancelled" and 5 <= len(stopped.token_ids) < 24
    want = plain(host, TURN1)
    assert stopped.token_ids == want[: len(stopped.token_ids)]
    again = host.generate("chat", TURN1, DRAFT)  # the same turn again: reuses the prompt's KV
    assert again.stats.cached_tokens > 0 and again.token_ids == want


def test_bad_speculative_settings_are_refused_before_the_cache_is_touched(host):
    host.generate("chat", TURN1, PLAIN)
    held = list(host.session("chat").ids)
    for params, needle in (
        (replace(NGRAM, num_draft_tokens=0), "at least 1"),
        (replace(NGRAM, ngram_size=0), "n >= 1"),
        (replace(PLAIN, speculative="magic"), "unknown speculative mode"),
    ):
        with pytest.raises(EngineError, match=needle):
            host.generate("chat", TURN1, params)
    assert host.session("chat").ids == held
