"""Saved caches by block (engine/runtime/saved_cache.py, engine/kv_files.py): chats that start
the same way share block files on disk, a restore equals a fresh run, a missing block is
refused in one line, one-file caches from before still load, and the folder's bytes count
each block once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import kv_files
from engine.api import GenerationParams, SamplingParams
from engine.runtime import saved_cache
from engine.runtime.host import ModelHost
from tests.engine.runtime.tiny_folder import make_tiny_model_folder

PARAMS = GenerationParams(max_tokens=5, sampling=SamplingParams(temperature=0.0), ignore_eos=True, logprobs=True)
SYSTEM = [1] + [(7 * i + 3) % 250 + 4 for i in range(200)]  # a shared start: 3 whole blocks of 64
CHAT_A = SYSTEM + [40, 41, 42, 43, 44]
CHAT_B = SYSTEM + [50, 51, 52]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("blocks") / "tiny-llama")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(saved_cache, "SAVED_BLOCK_TOKENS", 64)


def _host(folder: Path, paged: bool = False) -> ModelHost:
    host = ModelHost()
    host.load(str(folder), paged_kv_block_size=16 if paged else None)
    return host


def _blocks(store: Path) -> set[str]:
    return {p.stem for p in (store / kv_files.BLOCKS).glob("*.safetensors")}


@pytest.mark.parametrize("paged", [False, True])
def test_chats_sharing_a_start_share_its_blocks_and_restore_exactly(folder, tmp_path, paged):
    host = _host(folder, paged)
    a = host.generate_ids(CHAT_A, PARAMS, session_id="a")
    host.generate_ids(CHAT_B, PARAMS, session_id="b")
    first = host.save_session("a", str(tmp_path / "a.safetensors"))
    after_a = _blocks(tmp_path)
    second = host.save_session("b", str(tmp_path / "b.safetensors"))
    # A holds 209 tokens (3 whole blocks), B 207: the same 3 blocks, written once.
    assert len(after_a) == 3 and _blocks(tmp_path) == after_a
    assert second < first / 2  # B wrote only its session file (its 15-token tail)
    names = [kv_files.named_blocks(kv_files.header_metadata(tmp_path / f"{c}.safetensors")) for c in "ab"]
    assert names[0] == names[1] and set(names[0]) == after_a
    sessions = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    unique = kv_files.folder_bytes(tmp_path, sessions)
    assert unique < sum(kv_files.session_bytes(p) for p in sessions)

    held = CHAT_A + a.token_ids[:-1]
    fresh = _host(folder, paged)  # as after a restart
    assert fresh.restore_session("a", str(tmp_path / "a.safetensors")) == (len(held), "")
    again = fresh.generate_ids(held + [60, 61], PARAMS, session_id="a")
    plain = _host(folder).generate_ids(held + [60, 61], PARAMS, session_id="x")
    assert again.stats.cached_tokens == len(held) and plain.stats.cached_tokens == 0
    assert again.token_ids == plain.token_ids
    assert again.token_logprobs and plain.token_logprobs
    assert max(abs(x - y) for x, y in zip(again.token_logprobs, plain.token_logprobs)) < 1e-4


def test_a_missing_block_is_refused_in_one_line_and_the_next_save_writes_it(folder, tmp_path):
    host = _host(folder)
    host.generate_ids(CHAT_A, PARAMS, session_id="a")
    path = tmp_path / "a.safetensors"
    host.save_session("a", str(path))
    lost = sorted(_blocks(tmp_path))[0]
    kv_files.block_file(tmp_path, lost).unlink()
    fresh = _host(folder)
    restored, why = fresh.restore_session("a", str(path))
    assert restored == 0 and "missing" in why and "\n" not in why
    result = fresh.generate_ids(CHAT_A, PARAMS, session_id="a")  # the turn prefills in full
    assert result.stats.cached_tokens == 0
    fresh.save_session("a", str(path))
    assert lost in _blocks(tmp_path)
    assert _host(folder).restore_session("a", str(path))[0] > 0


def test_a_one_file_cache_from_before_still_loads(folder, tmp_path):
    from engine.models.kv_cache import save_prompt_cache

    host = _host(folder)
    host.generate_ids(CHAT_A, PARAMS, session_id="a")
    chat = host.session("a")
    path = tmp_path / "old.safetensors"
    save_prompt_cache(path, chat.cache, {**host.session_identity(), "token_ids": str(chat.ids)})
    assert not (tmp_path / kv_files.BLOCKS).exists()
    assert _host(folder).restore_session("a", str(path)) == (len(chat.ids), "")


def test_collecting_removes_only_the_blocks_no_session_names(folder, tmp_path):
    host = _host(folder)
    host.generate_ids(CHAT_A, PARAMS, session_id="a")
    host.generate_ids(SYSTEM[:100] + [9] * 100, PARAMS, session_id="c")  # one block shared with A
    a, c = tmp_path / "a.safetensors", tmp_path / "c.safetensors"
    host.save_session("a", str(a))
    host.save_session("c", str(c))
    assert len(_blocks(tmp_path)) == 5  # A's 3, C's 2 more (its first is A's)
    assert kv_files.collect(tmp_path, [a, c], grace_s=0) == 0
    c.unlink()
    assert kv_files.collect(tmp_path, [a]) == 0  # just written: a save may be under way
    freed = kv_files.collect(tmp_path, [a], grace_s=0)
    assert freed > 0 and _blocks(tmp_path) == set(kv_files.named_blocks(kv_files.header_metadata(a)))
    assert _host(folder).restore_session("a", str(a))[0] > 0
