"""Prefix reuse with recurrent layers (Qwen3.5's DeltaNet, LFM2's convolutions), whose state
cannot be cut back: the session returns to snapshots taken at turn boundaries.

Every reply is compared with a fresh session's (ids and log-probs), so a state reused at
the wrong point fails; the tokens each request feeds are counted, so a snapshot missed or
not taken fails too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.api import GenerationParams
from engine.models.recurrent_cache import MAX_SNAPSHOTS, RecurrentCache
from engine.runtime.session import ChatSession
from engine.text.chat_template import ChatTemplate

from .tinymodel import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hybrid_families import build  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<{{ m.role | upper }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<ASSISTANT>{% endif %}"
)
PARAMS = GenerationParams(max_tokens=6, ignore_eos=True, logprobs=True)


class Counting:
    """The model, counting the tokens each forward pass feeds."""

    def __init__(self, model):
        self._model = model
        self.fed = 0

    def __call__(self, inputs, cache=None, **kwargs):
        self.fed += inputs.shape[1]
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2"])
def model(request) -> Counting:
    return Counting(build(request.param)[0])


def session(model) -> ChatSession:
    return ChatSession(model, ByteTokenizer(), ChatTemplate(TEMPLATE))


def ask(chat: ChatSession, messages):
    """(result, tokens fed to the model by this request, prompt length)."""
    before = chat.model.fed
    result = chat.generate(messages, PARAMS)
    prompt = len(chat.encode_rendered(chat.render(messages)))
    return result, chat.model.fed - before, prompt


def same_as_fresh(model, messages, result):
    fresh = session(model).generate(messages, PARAMS)
    assert result.token_ids == fresh.token_ids
    assert max(abs(a - b) for a, b in zip(result.token_logprobs, fresh.token_logprobs)) < 1e-4


def test_three_turns_with_an_edit_and_a_regenerate(model):
    chat = session(model)
    decode_steps = PARAMS.max_tokens - 1
    turn1 = [{"role": "user", "content": "HELLO THERE, HOW ARE THINGS"}]
    r1, fed, n1 = ask(chat, turn1)
    assert r1.stats.cached_tokens == 0 and fed == n1 + decode_steps
    same_as_fresh(model, turn1, r1)
    end1 = n1 + decode_steps  # what the cache holds after turn one

    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "AND THEN?"}]
    r2, fed, n2 = ask(chat, turn2)
    assert r2.stats.cached_tokens == end1  # a follow-up prefills only its new tokens
    assert fed == n2 - end1 + decode_steps
    same_as_fresh(model, turn2, r2)
    end2 = n2 + decode_steps

    turn3 = turn2 + [{"role": "assistant", "content": r2.text}, {"role": "user", "content": "GO ON"}]
    r3, fed, n3 = ask(chat, turn3)
    assert r3.stats.cached_tokens == end2 and fed == n3 - end2 + decode_steps
    same_as_fresh(model, turn3, r3)

    # Edit the second question: the state goes back to the end of turn one (the nearest
    # snapshot before the edit), never to a state that has seen the old question.
    edited = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "AND NOW?"}]
    r4, fed, n4 = ask(chat, edited)
    assert r4.stats.cached_tokens == end1 and fed == n4 - end1 + decode_steps
    same_as_fresh(model, edited, r4)

    # Regenerate: the same prompt again feeds only its last token.
    r5, fed, _ = ask(chat, edited)
    assert r5.stats.cached_tokens == n4 - 1 and fed == 1 + decode_steps
    assert r5.token_ids == r4.token_ids

    # Edit the first question: no snapshot lies before it, so everything is prefilled again.
    first = [{"role": "user", "content": "HELLO THERE, WHAT IS NEW"}]
    r6, fed, n6 = ask(chat, first)
    assert r6.stats.cached_tokens == 0 and fed == n6 + decode_steps
    same_as_fresh(model, first, r6)


def test_snapshots_stay_bounded(model):
    chat = session(model)
    messages = []
    for i in range(MAX_SNAPSHOTS + 3):
        messages.append({"role": "user", "content": f"QUESTION {i}"})
        reply = chat.generate(messages, PARAMS)
        messages.append({"role": "assistant", "content": reply.text})
    for c in chat.cache:
        if isinstance(c, RecurrentCache):
            assert len(c._snapshots) <= MAX_SNAPSHOTS


def test_mtp_drafting_in_a_chat_keeps_every_reply():
    """Built-in MTP drafting over a regenerate (all but one token cached, so the drafter has
    seen no hidden state yet), follow-up turns (partly cached prompts) and another
    regenerate: the same replies as plain decoding, and the model is left without a listener."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
    from dataclasses import replace

    from test_mtp import with_mtp

    target, _ = with_mtp("qwen3_5")
    chat, plain = session(target), session(target)
    mtp = replace(PARAMS, speculative="mtp", num_draft_tokens=2, max_tokens=8)
    messages = [{"role": "user", "content": "TELL ME ABOUT IT"}]
    chat.generate(messages, replace(mtp, speculative=None))  # the MTP request below regenerates it
    for turn in range(3):
        got = chat.generate(messages, mtp)
        want = plain.generate(messages, replace(mtp, speculative=None))
        assert got.token_ids == want.token_ids and got.stats.draft_tokens > 0
        assert target.hidden_listener is None
        messages += [{"role": "assistant", "content": got.text}, {"role": "user", "content": f"MORE {turn}"}]
    again = chat.generate(messages[:-2], mtp)  # regenerate the last reply
    assert again.token_ids == got.token_ids
