"""/v1/completions as lm-eval's ``local-completions`` drives it: loglikelihood sends batches
of token-id prompts with ``echo``, ``logprobs`` and ``max_tokens`` 0 or 1 and reads the
prompt's own log-probabilities. The echoed numbers must be the ones generation reports
for the same tokens (within 1e-4), and the batch must answer as its prompts one by one."""

from __future__ import annotations

import math

import openai
import pytest

from .conftest import API_KEY

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _loglikelihood(client, context_ids: list[list[int]], continuation_ids: list[list[int]]):
    """lm-eval's request and parsing (lm_eval/models/openai_completions.py, local-completions):
    one request for the batch, echo + logprobs 1 + max_tokens 1, the continuation's
    log-probabilities summed, greedy when each is the top one."""
    prompts = [c + k for c, k in zip(context_ids, continuation_ids, strict=True)]
    out = client.completions.create(
        model="tiny-chat", prompt=prompts, temperature=0, max_tokens=1, logprobs=1, echo=True, seed=1234
    )
    results = []
    for choice, ctx in zip(sorted(out.choices, key=lambda c: c.index), context_ids, strict=True):
        lps = choice.logprobs.token_logprobs[len(ctx) : -1]
        tops = choice.logprobs.top_logprobs[len(ctx) : -1]
        results.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))))
    return results


def test_echo_logprobs_are_the_continuations_own(client):
    generated = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    ctx = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    n_ctx = len(ctx.choices[0].logprobs.tokens)
    echoed = client.completions.create(
        model="tiny-chat", prompt=PROMPT + generated.choices[0].text, max_tokens=0, echo=True, logprobs=3
    )
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = generated.choices[0].logprobs.token_logprobs
    got = lp.token_logprobs[n_ctx:]
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    # Greedy tokens are their position's best, with the very same number in the top list.
    for token, value, top in zip(lp.tokens[n_ctx:], got, lp.top_logprobs[n_ctx:], strict=True):
        assert top[token] == value == max(top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert "".join(lp.tokens) == echoed.choices[0].text == PROMPT + generated.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert echoed.usage.completion_tokens == 0 and echoed.choices[0].finish_reason == "length"


def test_loglikelihood_batch_matches_single_requests(client):
    base = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    ids = [5, 17, 42, 230, 259, 208, 252, 235, 100, 7]
    contexts, continuations = [ids[:4], ids[:2], ids[:7]], [ids[4:8], ids[2:3], ids[7:]]
    batch = _loglikelihood(client, contexts, continuations)
    alone = [_loglikelihood(client, [c], [k])[0] for c, k in zip(contexts, continuations, strict=True)]
    assert [round(s, 4) for s, _ in batch] == [round(s, 4) for s, _ in alone]
    assert all(math.isfinite(s) and s < 0 for s, _ in batch)
    assert base.choices[0].text == PROMPT


def test_max_tokens_zero_without_echo_writes_nothing(client):
    out = client.completions.create(model="tiny-chat", prompt=["hello", "there"], max_tokens=0)
    assert [c.text for c in out.choices] == ["", ""] and [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens > 0


def test_n_choices_and_batches_index_in_order(client):
    out = client.completions.create(model="tiny-chat", prompt=["hello", [5, 6, 7]], max_tokens=3, n=2, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    greedy = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=4, n=3, temperature=0)
    assert len({c.text for c in greedy.choices}) == 1
    chat = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3, temperature=0
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 1
    assert chat.usage.completion_tokens % 3 == 0  # three equal greedy replies, each counted
    stream = list(
        client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=2,
            temperature=0,
            stream=True,
        )
    )
    texts = [
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == i)
        for i in (0, 1)
    ]
    assert texts == [chat.choices[0].message.content] * 2
