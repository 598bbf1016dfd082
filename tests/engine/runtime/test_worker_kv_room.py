"""The per-admission KV check through the worker: with a memory budget that leaves room
for one request's KV cache at full length, a second waits for the first to finish, and a
request for more than that room holds stops where the context planner put the context."""

from __future__ import annotations

from engine.api import Complete, DoneEvent, GenerationParams, LoadModel, TokenEvent
from engine.runtime.worker import EngineWorker
from engine.serve.http import engine_error
from tests.engine.runtime.test_worker import Events


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_tokens=n, ignore_eos=True)


def test_a_request_waits_for_kv_room_and_one_that_never_fits_is_refused(tiny_model_dir):
    events = Events()
    w = EngineWorker(events)
    w.start()
    try:
        info = events.end_of(w.submit(LoadModel(str(tiny_model_dir)))).result
        weights, per_token = info.plan.weights_bytes, info.plan.kv_bytes_per_token
        # Room for 100 tokens of KV beside the weights: one 10 + 60 token request, not two.
        done = events.end_of(w.submit(LoadModel(str(tiny_model_dir), memory_budget=weights + 100 * per_token)))
        assert isinstance(done, DoneEvent), done
        first = w.submit(Complete("a", list(range(5, 15)), greedy(60)))
        second = w.submit(Complete("b", list(range(7, 17)), greedy(30)))
        ends = [events.end_of(first), events.end_of(second)]
        assert all(isinstance(e, DoneEvent) for e in ends), ends
        assert len(ends[0].result.token_ids) == 60 and len(ends[1].result.token_ids) == 30
        order = [e for e in list(events.items) if isinstance(e, TokenEvent | DoneEvent)]
        first_done = next(i for i, e in enumerate(order) if isinstance(e, DoneEvent) and e.request_id == first)
        second_token = next(i for i, e in enumerate(order) if isinstance(e, TokenEvent) and e.request_id == second)
        assert second_token > first_done  # it waited for room instead of overrunning the budget

        # Asked for more than the budget's KV room holds: the context planner made that room
        # the chat's context, so the reply stops there (finish reason "length") instead of
        # being refused. (A request that cannot fit while the context allows it, because
        # something else holds the room, is refused: tests/engine/decode/test_batch_prefill.py.)
        capped = events.end_of(w.submit(Complete("c", list(range(5, 15)), greedy(200))))
        assert isinstance(capped, DoneEvent), capped
        assert capped.result.finish_reason == "length" and 10 + len(capped.result.token_ids) == 100
        assert engine_error("OutOfKVRoom", "no room").status == 503
        # The worker carries on.
        assert isinstance(events.end_of(w.submit(Complete("d", [5, 6, 7], greedy(4)))), DoneEvent)
    finally:
        assert w.shutdown(10)
