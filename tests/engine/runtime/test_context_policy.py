"""Context overflow policies at the edge of a 256-token model: what is kept, and no errors."""

from __future__ import annotations

import json

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.runtime.context_policy import fit_messages, reply_room
from engine.runtime.host import ModelHost
from tests.engine.runtime.tiny_folder import make_tiny_model_folder

LIMIT = 256


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> ModelHost:
    folder = make_tiny_model_folder(tmp_path_factory.mktemp("ctx") / "tiny-256")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LIMIT}))
    h = ModelHost()
    assert h.load(str(folder)).context_length == LIMIT
    return h


def _chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: the quick brown fox jumps over the lazy dog"})
        messages.append({"role": "assistant", "content": f"answer {i}: hello there how are you today"})
    messages.append({"role": "user", "content": "last question: what is the capital of france"})
    return messages


def _params(policy: str | None, max_tokens: int = 40) -> GenerationParams:
    return GenerationParams(
        max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True, context_policy=policy
    )


def _count(messages) -> int:
    return sum(len(m["content"].split()) + 2 for m in messages)


def test_fit_keeps_the_system_prompt_and_first_exchange_or_only_the_latest_turns():
    messages = _chat(6)
    kept, dropped = fit_messages(messages, _count, 60, 10, "truncate_middle")
    assert kept[:3] == messages[:3] and kept[-1] == messages[-1] and kept[3]["role"] == "user"
    assert dropped == len(messages) - len(kept) and _count(kept) <= 50
    rolled, dropped = fit_messages(messages, _count, 60, 10, "rolling")
    assert rolled[0] == messages[0] and rolled[1]["role"] == "user" and rolled[-1] == messages[-1]
    assert rolled[1]["content"].startswith("question") and rolled[1] != messages[1]
    assert _count(rolled) <= 50 and dropped == len(messages) - len(rolled)
    assert fit_messages(messages, _count, 60, 10, "stop") == (messages, 0)
    assert fit_messages(messages[:2], _count, 60, 10, "rolling") == (messages[:2], 0)
    # Even the latest turn alone does not fit: it stays (the engine refuses it).
    assert fit_messages(messages, _count, 8, 2, "rolling")[0] == [messages[0], messages[-1]]
    assert reply_room(256, 10_000) == 64 and reply_room(256, 10) == 10


@pytest.mark.parametrize("policy", ["truncate_middle", "rolling"])
def test_dropping_policies_fit_the_prompt_and_equal_a_chat_of_what_was_kept(host, policy):
    messages = _chat(12)
    whole = host.session("probe").encode_rendered(host.session("probe").render(messages))
    assert len(whole) > LIMIT  # the chat has outgrown the context
    result = host.generate(f"a-{policy}", messages, _params(policy))
    assert result.dropped_messages > 0 and result.finish_reason == "length"
    assert result.stats.prompt_tokens + reply_room(LIMIT, 40) <= LIMIT
    assert result.stats.prompt_tokens + result.stats.generated_tokens <= LIMIT
    kept = (
        messages[:3] + messages[3 + result.dropped_messages :]
        if policy == "truncate_middle"
        else messages[:1] + messages[1 + result.dropped_messages :]
    )
    # The result names the messages the prompt held: the transcript marks the gap by them.
    head = 3 if policy == "truncate_middle" else 1
    assert result.kept_messages == list(range(head)) + list(range(head + result.dropped_messages, len(messages)))
    assert [messages[i] for i in result.kept_messages] == kept
    plain = host.generate(f"b-{policy}", kept, _params(None))
    assert plain.token_ids == result.token_ids and plain.stats.prompt_tokens == result.stats.prompt_tokens


def test_stop_caps_the_reply_at_the_limit_and_says_so(host):
    messages = _chat(1)
    result = host.generate("stop", messages, _params("stop", max_tokens=1000))
    assert result.stats.prompt_tokens < LIMIT
    assert result.dropped_messages == 0 and result.finish_reason == "length" and result.context_full
    assert result.kept_messages is None  # nothing dropped
    assert result.stats.prompt_tokens + result.stats.generated_tokens == LIMIT
    short = host.generate("stop2", messages, _params("stop", max_tokens=5))
    assert short.finish_reason == "length" and not short.context_full
