"""The worker thread against a real tiny model folder: load, generate, cancel, errors."""

from __future__ import annotations

import threading
import time

import pytest

from engine.api import (
    Cancel,
    DoneEvent,
    DropSession,
    ErrorEvent,
    Generate,
    GenerationParams,
    GenerationResult,
    InspectModel,
    LoadModel,
    MemoryEvent,
    ModelInfo,
    ProgressEvent,
    SamplingParams,
    TokenEvent,
    UnloadModel,
)
from engine.runtime.worker import EngineWorker

HELLO = [{"role": "user", "content": "hello how are you"}]


class Events:
    def __init__(self) -> None:
        self.items: list = []
        self.cond = threading.Condition()
        self.threads: set[str] = set()

    def __call__(self, event) -> None:
        with self.cond:
            self.items.append(event)
            self.threads.add(threading.current_thread().name)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.items:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; events: {self.items[-5:]}")
                self.cond.wait(left)

    def end_of(self, rid: int):
        return self.wait(lambda e: isinstance(e, DoneEvent | ErrorEvent) and e.request_id == rid)

    def of(self, rid: int, kind) -> list:
        with self.cond:
            return [e for e in self.items if isinstance(e, kind) and getattr(e, "request_id", None) == rid]


@pytest.fixture()
def worker():
    events = Events()
    w = EngineWorker(events)
    w.start()
    yield w, events
    assert w.shutdown(10)


def test_load_generate_and_events(worker, tiny_model_dir):
    w, ev = worker
    rid = w.submit(LoadModel(str(tiny_model_dir)))
    done = ev.end_of(rid)
    assert isinstance(done, DoneEvent) and isinstance(done.result, ModelInfo)
    assert done.result.family == "llama"
    assert ev.of(rid, ProgressEvent), "loading reports progress"
    assert any(isinstance(e, MemoryEvent) for e in ev.items)

    gid = w.submit(Generate("chat", HELLO, GenerationParams(max_tokens=12, ignore_eos=True)))
    done = ev.end_of(gid)
    assert isinstance(done, DoneEvent), done
    result = done.result
    assert isinstance(result, GenerationResult) and result.finish_reason == "length"
    assert len(result.token_ids) == 12
    tokens = ev.of(gid, TokenEvent)
    assert "".join(t.text for t in tokens) == result.text
    assert ev.threads == {"engine-worker"}  # every event comes from the one MLX thread

    # The follow-up turn reuses the first turn's cache.
    turn2 = HELLO + [{"role": "assistant", "content": result.text}, {"role": "user", "content": "and you"}]
    done2 = ev.end_of(w.submit(Generate("chat", turn2, GenerationParams(max_tokens=4, ignore_eos=True))))
    assert done2.result.stats.cached_tokens > 0
    ev.end_of(w.submit(DropSession("chat")))
    done3 = ev.end_of(w.submit(Generate("chat", turn2, GenerationParams(max_tokens=4, ignore_eos=True))))
    assert done3.result.stats.cached_tokens == 0
    assert done3.result.token_ids == done2.result.token_ids


def test_cancel_mid_decode_is_out_of_band(worker, tiny_model_dir):
    w, ev = worker
    ev.end_of(w.submit(LoadModel(str(tiny_model_dir))))
    gid = w.submit(Generate("s", HELLO, GenerationParams(max_tokens=5000, ignore_eos=True)))
    queued = w.submit(Generate("t", HELLO, GenerationParams(max_tokens=3, ignore_eos=True)))
    ev.wait(lambda e: isinstance(e, TokenEvent) and e.request_id == gid)
    cid = w.submit(Cancel(gid))  # the queue is busy with gid: this must not wait behind it
    assert isinstance(ev.end_of(cid), DoneEvent)
    done = ev.end_of(gid)
    assert isinstance(done, DoneEvent) and done.result.finish_reason == "cancelled"
    assert 0 < len(done.result.token_ids) < 5000
    after = ev.end_of(queued)
    assert after.result.finish_reason == "length"  # the worker carries on


def test_cancel_before_start(worker, tiny_model_dir):
    w, ev = worker
    lid = w.submit(LoadModel(str(tiny_model_dir)))
    gid = w.submit(Generate("s", HELLO, GenerationParams(max_tokens=50, ignore_eos=True)))
    w.submit(Cancel(gid))
    ev.end_of(lid)
    done = ev.end_of(gid)
    assert done.result.finish_reason == "cancelled" and done.result.token_ids == []


def test_errors_end_one_request_and_the_worker_stays_usable(worker, tiny_model_dir, tmp_path):
    w, ev = worker
    err = ev.end_of(w.submit(Generate("s", HELLO)))
    assert isinstance(err, ErrorEvent) and "No model is loaded" in err.message
    err = ev.end_of(w.submit(LoadModel(str(tmp_path / "missing"))))
    assert isinstance(err, ErrorEvent) and "\n" not in err.message and err.message
    ev.end_of(w.submit(LoadModel(str(tiny_model_dir))))
    bad_params = GenerationParams(sampling=SamplingParams(temperature=1.0, top_p=0.0))
    bad = ev.end_of(w.submit(Generate("s", HELLO, bad_params)))
    assert isinstance(bad, ErrorEvent) and "top-p" in bad.message
    ok = ev.end_of(w.submit(Generate("s", HELLO, GenerationParams(max_tokens=3, ignore_eos=True))))
    assert isinstance(ok, DoneEvent) and len(ok.result.token_ids) == 3
    info = ev.end_of(w.submit(InspectModel(str(tiny_model_dir))))
    assert isinstance(info.result, ModelInfo) and info.result.plan is not None
    ev.end_of(w.submit(UnloadModel()))
    err = ev.end_of(w.submit(Generate("s", HELLO)))
    assert isinstance(err, ErrorEvent)


def test_a_failing_listener_does_not_stop_the_worker(tiny_model_dir):
    seen = []

    def listener(event):
        seen.append(event)
        raise RuntimeError("listener bug")

    w = EngineWorker(listener)
    w.start()
    try:
        w.submit(LoadModel(str(tiny_model_dir)))
        gid = w.submit(Generate("s", HELLO, GenerationParams(max_tokens=2, ignore_eos=True)))
        deadline = time.monotonic() + 60
        while not any(isinstance(e, DoneEvent) and e.request_id == gid for e in seen):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        assert w.shutdown(10)
