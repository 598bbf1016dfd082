"""Reopening a saved chat chooses the faster way (runtime/reopen_choice.py): reading the
saved cache or prefilling the chat again, by the disk's and the model's measured rates.
Either way the reply is the one a never-saved chat gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.runtime.host import ModelHost
from engine.runtime.reopen_choice import MARGIN, choose, disk_read_rate, saved_token_count
from tests.engine.runtime.tiny_folder import make_tiny_model_folder

PARAMS = GenerationParams(max_tokens=6, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
FIRST = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
SECOND = FIRST + [40, 41, 42, 43]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("reopen") / "tiny-llama")


def test_the_faster_estimate_wins():
    # A 16k-token chat of 2.4 GB: at 1.1 GB/s the read takes 2.2 s, a 14k tok/s prefill 1.2 s.
    assert choose(16_384, 2_416_000_000, 1.1e9, 14_000).path == "recompute"
    # The same file at 7 GB/s (a Mac's SSD) reads in 0.35 s.
    assert choose(16_384, 2_416_000_000, 7e9, 14_000).path == "read"
    # Recompute only when clearly faster: within the margin the file is read.
    close = choose(1000, 1000, 1000.0, 1000 * MARGIN * 0.99)
    assert close.path == "read" and close.recompute_s < close.read_s


@pytest.mark.parametrize("prefill_tps", [1.0, 1e12])  # reading wins; recomputing wins
def test_a_reopened_chat_replies_as_a_fresh_one_whichever_way_it_went(folder, tmp_path, prefill_tps):
    path = tmp_path / "chat.safetensors"
    host = ModelHost()
    host.load(str(folder))
    first = host.generate_ids(FIRST, PARAMS, session_id="a")
    assert host.save_session("a", str(path)) > 0
    assert saved_token_count(path) == len(FIRST) + len(first.token_ids) - 1
    assert disk_read_rate(path) > 0

    fresh = ModelHost()
    fresh.load(str(folder))
    fresh._need().model.measured_prefill_tps = prefill_tps  # as if measured so
    tokens, why = fresh.restore_session("b", str(path))
    choice = fresh.session("b").reopen_choice
    if prefill_tps == 1.0:
        assert choice.path == "read" and tokens == saved_token_count(path) and why == ""
    else:
        assert choice.path == "recompute" and tokens == 0 and "faster than reading" in why
    again = fresh.generate_ids(SECOND, PARAMS, session_id="b")
    plain = ModelHost()
    plain.load(str(folder))
    assert again.token_ids == plain.generate_ids(SECOND, PARAMS, session_id="c").token_ids
    assert again.stats.cached_tokens == (len(FIRST) if prefill_tps == 1.0 else 0)
