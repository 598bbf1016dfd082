"""Continuous batching through the worker: requests that arrive together decode together,
each as it would alone; a newcomer's prefill is interleaved with the others' steps; a
cancel ends only its own request; a command that cannot join waits for the batch."""

from __future__ import annotations

import pytest

from engine.api import (
    Cancel,
    Complete,
    DoneEvent,
    Generate,
    GenerationParams,
    GetModelInfo,
    LoadModel,
    ProgressEvent,
    SamplingParams,
    TokenEvent,
    UnloadModel,
)
from engine.runtime.worker import EngineWorker
from tests.engine.runtime.test_worker import Events

PROMPTS = ["hello how are you", "Once upon a time there was", "the quick brown fox", "I am fine"]


def greedy(n: int, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True, **kw)


@pytest.fixture()
def worker(tiny_model_dir):
    events = Events()
    w = EngineWorker(events)
    w.start()
    events.end_of(w.submit(LoadModel(str(tiny_model_dir))))
    yield w, events
    w.shutdown()


def alone(worker, events, command):
    """Run one command with nothing else in flight; its result."""
    rid = worker.submit(command)
    done = events.end_of(rid)
    assert isinstance(done, DoneEvent), done
    return done.result


def chat(text: str, params: GenerationParams, session: str) -> Generate:
    return Generate(session, [{"role": "user", "content": text}], params)


def test_requests_submitted_together_decode_together_and_each_as_alone(worker):
    w, events = worker
    params = [greedy(12), greedy(7), greedy(9, sampling=SamplingParams(temperature=0.8, seed=4)), greedy(5)]
    rids = [w.submit(chat(p, q, f"s{i}")) for i, (p, q) in enumerate(zip(PROMPTS, params, strict=True))]
    together = [events.end_of(r) for r in rids]
    assert all(isinstance(d, DoneEvent) for d in together), together
    # They overlapped: the first ended after the others had produced tokens.
    order = [e for e in events.items if isinstance(e, TokenEvent | DoneEvent) and e.request_id in rids]
    first_done = next(i for i, e in enumerate(order) if isinstance(e, DoneEvent))
    assert len({e.request_id for e in order[:first_done] if isinstance(e, TokenEvent)}) == len(rids)
    steps = w.host.batch.steps
    assert steps < sum(q.max_tokens for q in params)
    for i, (prompt, q) in enumerate(zip(PROMPTS, params, strict=True)):
        ref = alone(w, events, chat(prompt, q, f"ref{i}"))
        got = together[i].result
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref.token_logprobs, strict=True)) < 1e-4
        # Streamed pieces carry exactly the result's tokens.
        streamed = [t for e in events.of(rids[i], TokenEvent) for t in e.token_ids]
        assert streamed == got.token_ids


def test_a_long_prompt_is_prefilled_between_the_running_ones_steps(worker):
    w, events = worker
    running = w.submit(Complete("a", "hello", greedy(60)))
    events.wait(lambda e: isinstance(e, TokenEvent) and e.request_id == running)
    long_prompt = list(range(5, 5 + 80))
    newcomer = w.submit(Complete("b", long_prompt, greedy(3, prefill_chunk=8)))
    events.end_of(newcomer)
    seen = [e for e in list(events.items) if getattr(e, "request_id", None) in (running, newcomer)]
    chunks = [i for i, e in enumerate(seen) if isinstance(e, ProgressEvent) and e.request_id == newcomer]
    assert len(chunks) >= 9  # 79 prompt tokens in chunks of 8

    # The running request kept decoding while the newcomer prefilled (one step per chunk;
    # tests/engine/decode/test_batch.py checks that exactly): its count went on growing.
    # Pieces may hold a token back (incomplete UTF-8), so the count is read off their stats.
    def generated_before(i: int) -> int:
        pieces = [e for e in seen[:i] if isinstance(e, TokenEvent) and e.request_id == running]
        return pieces[-1].stats.generated_tokens if pieces else 0

    assert generated_before(chunks[-1]) - generated_before(chunks[0]) >= (len(chunks) - 1) // 2
    w.submit(Cancel(running))
    events.end_of(running)


def test_cancel_ends_only_its_own_sequence(worker):
    w, events = worker
    params = greedy(40)
    keep = w.submit(chat(PROMPTS[0], params, "k"))
    stop = w.submit(chat(PROMPTS[1], params, "c"))
    events.wait(lambda e: isinstance(e, TokenEvent) and e.request_id == stop)
    w.submit(Cancel(stop))
    cancelled = events.end_of(stop).result
    kept = events.end_of(keep).result
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 40
    assert kept.finish_reason == "length"
    assert kept.token_ids == alone(w, events, chat(PROMPTS[0], params, "ref")).token_ids


def test_same_session_twice_at_once_and_a_held_command_in_order(worker, tiny_model_dir):
    w, events = worker
    a = w.submit(chat(PROMPTS[0], greedy(10), "same"))
    b = w.submit(chat(PROMPTS[0], greedy(10), "same"))
    info = w.submit(GetModelInfo())  # answered at once, beside the batch
    unload = w.submit(UnloadModel())  # waits for the batch to drain
    late = w.submit(chat(PROMPTS[1], greedy(3), "late"))  # behind the unload: no model
    ra, rb = events.end_of(a).result, events.end_of(b).result
    assert ra.token_ids == rb.token_ids
    assert isinstance(events.end_of(info), DoneEvent)
    assert isinstance(events.end_of(unload), DoneEvent)
    assert "load" in events.end_of(late).message.lower()
    ids = [e.request_id for e in events.items if isinstance(e, DoneEvent) or hasattr(e, "message")]
    assert ids.index(unload) > max(ids.index(a), ids.index(b))


def test_a_session_decoded_in_the_batch_reuses_its_cache_next_turn(worker):
    w, events = worker
    first = [w.submit(chat(p, greedy(6), f"t{i}")) for i, p in enumerate(PROMPTS[:3])]
    replies = [events.end_of(r).result for r in first]
    turn = [
        {"role": "user", "content": PROMPTS[1]},
        {"role": "assistant", "content": replies[1].text},
        {"role": "user", "content": "and then?"},
    ]
    again = [w.submit(Generate("t1", turn, greedy(6))), w.submit(chat(PROMPTS[0], greedy(6), "other"))]
    follow = events.end_of(again[0]).result
    events.end_of(again[1])
    assert follow.stats.cached_tokens > 0
    fresh = alone(w, events, Generate("fresh", turn, greedy(6)))
    assert follow.token_ids == fresh.token_ids


def test_stop_strings_and_budgets_are_per_sequence(worker):
    w, events = worker
    full = alone(w, events, chat(PROMPTS[2], greedy(16), "full"))
    assert len(full.text) > 6
    stop = full.text[4:6]
    with_stop = alone(w, events, chat(PROMPTS[2], greedy(16, stop_strings=[stop]), "alone-stop"))
    assert with_stop.finish_reason == "stop" and stop not in with_stop.text
    rids = [
        w.submit(chat(PROMPTS[2], greedy(16, stop_strings=[stop]), "x")),
        w.submit(chat(PROMPTS[0], greedy(3), "y")),
        w.submit(chat(PROMPTS[2], greedy(16), "z")),
    ]
    stopped, short, long = (events.end_of(r).result for r in rids)
    assert (stopped.text, stopped.finish_reason) == (with_stop.text, "stop")
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    assert long.token_ids == full.token_ids
