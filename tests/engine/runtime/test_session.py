"""Prefix reuse across turns, checked against fresh sessions on the same model."""

from __future__ import annotations

import pytest

from engine.api import GenerationParams
from engine.runtime.session import ChatSession, common_prefix_length
from engine.text.chat_template import ChatTemplate

from .tinymodel import ByteTokenizer, TinyLM

TEMPLATE = (
    "{% for m in messages %}<{{ m.role | upper }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<ASSISTANT>{% endif %}"
)
PARAMS = GenerationParams(max_tokens=6, ignore_eos=True)


def _session(model: TinyLM) -> ChatSession:
    return ChatSession(model, ByteTokenizer(), ChatTemplate(TEMPLATE))


@pytest.fixture()
def model() -> TinyLM:
    return TinyLM(vocab=64, dim=32, seed=2)


def test_follow_up_turn_prefills_only_new_tokens(model):
    chat = _session(model)
    turn1 = [{"role": "user", "content": "HELLO THERE"}]
    r1 = chat.generate(turn1, PARAMS)
    assert r1.stats.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "AND MORE"}]
    prompt2 = chat.encode_rendered(chat.render(turn2))
    model.calls.clear()
    r2 = chat.generate(turn2, PARAMS)
    first_turn_len = len(chat.encode_rendered(chat.render(turn1)))
    # Everything up to the last token fed in turn one is reused.
    assert r2.stats.cached_tokens == first_turn_len + PARAMS.max_tokens - 1
    assert r2.stats.prompt_tokens == len(prompt2)
    prefilled = sum(model.calls) - (PARAMS.max_tokens - 1)  # minus decode steps
    assert prefilled == len(prompt2) - r2.stats.cached_tokens
    fresh = _session(model).generate(turn2, PARAMS)
    assert r2.token_ids == fresh.token_ids and r2.text == fresh.text


def test_editing_an_earlier_message_trims_to_the_common_prefix(model):
    chat = _session(model)
    conv = [{"role": "user", "content": "FIRST QUESTION"}]
    r1 = chat.generate(conv, PARAMS)
    conv2 = conv + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "NEXT"}]
    chat.generate(conv2, PARAMS)
    edited = [{"role": "user", "content": "FIRST QUERY"}]
    old = chat.ids[:]
    new = chat.encode_rendered(chat.render(edited))
    r3 = chat.generate(edited, PARAMS)
    assert r3.stats.cached_tokens == common_prefix_length(old, new) > 0
    assert r3.token_ids == _session(model).generate(edited, PARAMS).token_ids


def test_same_prompt_again_reuses_all_but_one_token(model):
    chat = _session(model)
    conv = [{"role": "user", "content": "SAME"}]
    r1 = chat.generate(conv, PARAMS)
    r2 = chat.generate(conv, PARAMS)  # regenerate: the prompt is a prefix of the cache
    n = len(chat.encode_rendered(chat.render(conv)))
    assert r2.stats.cached_tokens == n - 1
    assert r2.token_ids == r1.token_ids


def test_untrimmable_cache_is_rebuilt(model):
    stiff = TinyLM(vocab=64, dim=32, seed=2, trimmable=False)
    chat = _session(stiff)
    conv = [{"role": "user", "content": "ONE"}]
    r1 = chat.generate(conv, PARAMS)
    edited = [{"role": "user", "content": "TWO"}]
    r2 = chat.generate(edited, PARAMS)
    assert r2.stats.cached_tokens == 0
    assert r2.token_ids == _session(model).generate(edited, PARAMS).token_ids
    assert r1.token_ids == _session(model).generate(conv, PARAMS).token_ids


def test_ids_track_the_cache_after_cancel(model):
    import threading

    chat = _session(model)
    cancel = threading.Event()
    cancel.set()
    res = chat.generate([{"role": "user", "content": "STOP"}], PARAMS, cancel=cancel)
    assert res.finish_reason == "cancelled"
    assert len(chat.ids) == chat.cache[0].offset
