"""Token ids from outside reach MLX only when they name a row of the embedding: a prompt
of ids past the vocabulary (which once crashed the process in the batched step, or
answered garbage at exactly the vocabulary's size) ends only its own request with
InvalidTokenIds, on every path (batched, alone, scored), and the worker keeps serving."""

from __future__ import annotations

import json
import queue

import pytest

from engine.api import (
    Complete,
    DoneEvent,
    ErrorEvent,
    GenerationParams,
    LoadModel,
    PromptScores,
    SamplingParams,
    ScorePrompt,
)
from engine.runtime.worker import EngineWorker


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    events: queue.Queue = queue.Queue()
    w = EngineWorker(events.put)
    w.start()

    def call(command, timeout: float = 60.0):
        rid = w.submit(command)
        while True:
            event = events.get(timeout=timeout)
            if isinstance(event, DoneEvent | ErrorEvent) and event.request_id == rid:
                return event

    info = call(LoadModel(str(tiny_model_dir))).result
    yield call, info
    w.shutdown()


def _params(**kw) -> GenerationParams:
    return GenerationParams(max_tokens=4, sampling=SamplingParams(temperature=0.0), **kw)


@pytest.mark.parametrize("ids", [[10**9], [2**64], [-1], [5, 10**9], [True]], ids=str)
@pytest.mark.parametrize("speculative", [None, "ngram"])  # batched, and one at a time
def test_ids_past_the_vocabulary_end_only_their_request(worker, ids, speculative):
    call, _ = worker
    before = call(Complete("s", [5, 6, 7], _params(speculative=speculative))).result.token_ids
    bad = call(Complete("s", ids, _params(speculative=speculative)))
    assert isinstance(bad, ErrorEvent) and bad.kind == "InvalidTokenIds"
    assert "outside this model's vocabulary" in bad.message
    assert call(Complete("s", [5, 6, 7], _params(speculative=speculative))).result.token_ids == before


def test_the_vocabularys_size_is_past_it_and_the_last_row_is_not(worker, tiny_model_dir):
    call, _ = worker
    size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    for command in (Complete("s", [size], _params()), ScorePrompt([5, size])):
        refused = call(command)
        assert isinstance(refused, ErrorEvent) and f"(0 to {size - 1})" in refused.message
    assert isinstance(call(Complete("s", [size - 1], _params())), DoneEvent)
    scores = call(ScorePrompt([5, size - 1], top_logprobs=2)).result
    assert isinstance(scores, PromptScores) and scores.logprobs[0] is None and scores.logprobs[1] < 0
    assert [lp for _, lp in scores.top_logprobs[1]] == sorted((lp for _, lp in scores.top_logprobs[1]), reverse=True)
