"""A decision on the worker runs beside the generation batch: it is answered between the
batch's steps, while a long generation is still decoding, and it leaves that
generation's tokens as they would be alone."""

from __future__ import annotations

from engine.api import Decide, DoneEvent, Generate, GenerationParams, LoadModel, TokenEvent
from engine.runtime.worker import EngineWorker
from tests.engine.runtime.test_worker import Events


def test_a_decision_is_answered_while_a_generation_decodes(tiny_model_dir):
    events = Events()
    w = EngineWorker(events)
    w.start()
    try:
        events.end_of(w.submit(LoadModel(str(tiny_model_dir))))
        params = GenerationParams(max_tokens=150, ignore_eos=True)
        alone = events.end_of(w.submit(Generate("ref", [{"role": "user", "content": "hello"}], params))).result
        running = w.submit(Generate("a", [{"role": "user", "content": "hello"}], params))
        events.wait(lambda e: isinstance(e, TokenEvent) and e.request_id == running)
        assert w.host.batch is not None and w.status.decoding == 1
        decision = w.submit(Decide(candidates=[" fox", " dog"], prompt="the quick brown"))
        answered = events.end_of(decision)
        assert isinstance(answered, DoneEvent) and abs(sum(answered.result.probabilities) - 1.0) < 1e-9
        done = events.end_of(running)
        order = [e for e in events.items if isinstance(e, DoneEvent) and e.request_id in (running, decision)]
        assert [e.request_id for e in order] == [decision, running]
        assert done.result.token_ids == alone.token_ids
    finally:
        w.shutdown()
