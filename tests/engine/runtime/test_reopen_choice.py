"""Reopening a saved chat chooses the faster way (runtime/reopen_choice.py): reading the
saved cache or prefilling the chat again, by the disk's and the model's measured rates.
Either way the reply is the one a never-saved chat gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.runtime.host import ModelHost
from engine.runtime.reopen_choice import MARGIN, SPLIT_MARGIN, choose, disk_read_rate, saved_token_count, split_point
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


def test_both_at_once_where_the_chat_allows_it_and_it_is_clearly_sooner():
    # The 16k-token chat above: prefilling 10.7k tokens (0.76 s) while the rest is read (0.76 s)
    # beats recomputing it all (1.17 s) and reading it all (2.2 s).
    both = choose(16_384, 2_416_000_000, 1.1e9, 14_000, splittable=True)
    assert both.path == "split" and both.split_at == split_point(16_384, 2_416_000_000, 1.1e9, 14_000)
    assert 10_000 < both.split_at < 11_000 and both.split_s * SPLIT_MARGIN < both.recompute_s
    # Where one way alone is far faster, it is taken.
    assert choose(16_384, 2_416_000_000, 1.1e9, 1e9, splittable=True).path == "recompute"
    assert choose(16_384, 2_416_000_000, 1e12, 14_000, splittable=True).path == "read"
    # A chat whose caches cannot be split never is.
    assert choose(16_384, 2_416_000_000, 1.1e9, 14_000).path == "recompute"


def _reopened(folder: Path, path: Path, monkeypatch) -> ModelHost:
    """A fresh host whose estimates make reading and recomputing take 1 s each."""
    from engine.runtime import reopen_choice

    fresh = ModelHost()
    fresh.load(str(folder))
    monkeypatch.setattr(reopen_choice, "disk_read_rate", lambda p: Path(p).stat().st_size / 1.0)
    fresh._need().model.measured_prefill_tps = float(saved_token_count(path))
    return fresh


def test_a_chat_reopened_both_at_once_replies_as_a_fresh_one(folder, tmp_path, monkeypatch):
    path = tmp_path / "chat.safetensors"
    host = ModelHost()
    host.load(str(folder))
    host.generate_ids(FIRST, PARAMS, session_id="a")
    assert host.save_session("a", str(path)) > 0
    saved = saved_token_count(path)

    fresh = _reopened(folder, path, monkeypatch)
    tokens, why = fresh.restore_session("b", str(path))
    choice = fresh.session("b").reopen_choice
    assert choice.path == "split" and choice.split_at == round(saved / 2)
    assert tokens == saved and why == ""
    restored = fresh.session("b").cache
    assert all(int(c.offset) == saved for c in restored)
    again = fresh.generate_ids(SECOND, PARAMS, session_id="b")
    plain = ModelHost()
    plain.load(str(folder))
    expected = plain.generate_ids(SECOND, PARAMS, session_id="c")
    assert again.token_ids == expected.token_ids
    assert again.stats.cached_tokens == len(FIRST)


def test_a_truncated_file_reopened_both_at_once_is_skipped_and_the_chat_goes_on(folder, tmp_path, monkeypatch):
    path = tmp_path / "chat.safetensors"
    host = ModelHost()
    host.load(str(folder))
    host.generate_ids(FIRST, PARAMS, session_id="a")
    host.save_session("a", str(path))
    fresh = _reopened(folder, path, monkeypatch)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 64)  # the header is whole; the last rows are gone
    tokens, why = fresh.restore_session("b", str(path))
    assert fresh.session("b").reopen_choice.path == "split"
    assert tokens == 0 and why.startswith("the saved cache is unreadable")
    assert fresh.generate_ids(SECOND, PARAMS, session_id="b").stats.cached_tokens == 0
