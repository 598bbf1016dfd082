"""Rolling window mid-reply at the edge of a 256-token context (tiny llama): the reply goes
past the context, sliding the window along (the system prompt kept at its start), and each
stretch of it equals a fresh prefill of the kept window followed by greedy decoding."""

from __future__ import annotations

import json

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.decode.rolling import RollingWindow
from engine.runtime.host import ModelHost
from engine.runtime.session import common_prefix_length
from tests.tiny_models import make_tiny_llama

LIMIT = 256


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("roll") / "tiny-256")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LIMIT}))
    h = ModelHost()
    h.load(str(folder))
    yield h
    h.unload()


MESSAGES = [
    {"role": "system", "content": "You are a storyteller."},
    {"role": "user", "content": "tell me a long story about a fox " * 4},
]


def _params(policy: str | None, max_tokens: int) -> GenerationParams:
    # Greedy with a repetition penalty: a random tiny model left alone soon repeats one token
    # forever, which would make any window look right.
    sampling = SamplingParams(repetition_penalty=1.5)
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, context_policy=policy, sampling=sampling)


def test_the_reply_slides_past_the_context_and_equals_fresh_prefills_of_the_kept_window(host):
    session = host.session("probe")
    prompt = session.encode_rendered(session.render(MESSAGES))
    system = session.encode_rendered(session.render(MESSAGES[:1], add_generation_prompt=False))
    sink = common_prefix_length(system, prompt)
    assert 40 < len(prompt) < LIMIT // 2 and sink > 4

    result = host.generate("rolling", MESSAGES, _params("rolling", 400))
    assert result.finish_reason == "length" and result.error is None and not result.context_full
    assert result.stats.generated_tokens == 400 and len(prompt) + 400 > LIMIT + 200  # well past the context

    # Replay: each time the context filled, the window kept the system prompt and the latest
    # tokens; from there a fresh session must decode exactly what the reply did.
    window = RollingWindow(LIMIT, sink)
    ids, done, slides = list(prompt), 0, 0
    room = LIMIT - len(prompt)
    while done < 400:
        stretch = result.token_ids[done : done + room]
        if done:
            fresh = host.generate_ids(ids, _params(None, len(stretch)), session_id=f"fresh-{slides}")
            assert fresh.token_ids == stretch, f"after slide {slides}"
        ids += stretch
        done += len(stretch)
        if done < 400:
            ids = window.kept(ids)
            assert ids[:sink] == prompt[:sink]  # the system prompt stays
            room = LIMIT - len(ids)
            slides += 1
    assert slides >= 3
    assert len(set(result.token_ids[-100:])) > 30  # still varied at the end: the check means something

    # The cache holds the last window and the reply after it: the next turn reuses it.
    chat = host.session("rolling")
    assert chat.ids[:sink] == prompt[:sink] and len(chat.ids) < LIMIT
    assert chat.ids[-50:] == (prompt + result.token_ids)[-51:-1]  # the last token is not fed yet


def test_without_the_rolling_policy_the_reply_stops_at_the_context(host):
    result = host.generate("stop", MESSAGES, _params("stop", 400))
    assert result.finish_reason == "length" and result.context_full
    assert result.stats.prompt_tokens + result.stats.generated_tokens == LIMIT


def test_after_a_slide_the_result_names_the_messages_the_model_still_reads(host):
    """A slide mid-reply drops the oldest turns from what the model reads: the result's
    kept_messages / dropped_messages say so (the system prompt, kept as the sink, and the
    turns the kept latest tokens reach into), as they do for turns dropped before the reply."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} about the fox and the dog"}
        for i in range(7)
    ]
    messages = [MESSAGES[0], *turns]
    session = host.session("turns-probe")
    prompt = session.encode_rendered(session.render(messages))
    sink = common_prefix_length(
        session.encode_rendered(session.render(messages[:1], add_generation_prompt=False)), prompt
    )
    # Each message starts at its <|im_start|> (the template's one special token per message).
    marker = session.encode_rendered("<|im_start|>")[-1]
    starts = [i for i, t in enumerate(prompt) if t == marker]
    assert len(starts) == len(messages) + 1  # and the generation prompt's
    ends = starts[1:-1] + [len(prompt)]
    # One slide, a few tokens before the reply ends: the kept latest tokens begin at ``first``.
    room = LIMIT - len(prompt)
    assert room > LIMIT // 4  # nothing is dropped before the reply
    first = LIMIT - (len(RollingWindow(LIMIT, sink).kept(list(range(LIMIT)))) - sink)
    read = [0] + [j for j in range(1, len(messages)) if ends[j] > first]
    assert 1 < len(read) < len(messages)  # some turns still read, some not

    plain = host.generate("turns-plain", messages, _params("rolling", room))  # fits: nothing slides
    assert plain.dropped_messages == 0 and plain.kept_messages is None
    result = host.generate("turns", messages, _params("rolling", room + 10))
    assert result.stats.generated_tokens == room + 10
    assert result.kept_messages == read and result.dropped_messages == len(messages) - len(read)
