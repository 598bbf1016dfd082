"""KV caches of chats out of use are given back, least recently used first, when the
budget leaves no room: memory stays within the budget, and a chat whose cache was dropped
answers exactly as before when it comes back."""

from __future__ import annotations

import pytest

from engine.api import GenerationParams
from engine.host import ModelHost
from engine.kv_eviction import session_kv_bytes
from tests.tiny_models import make_tiny_llama

PROMPT = list(range(5, 205))  # 200 tokens
GREEDY = GenerationParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("mem") / "tiny")


def _host(model, budget=None) -> ModelHost:
    host = ModelHost()
    host.load(str(model), budget=budget)
    return host


def test_idle_chats_give_back_their_caches_within_the_budget(model):
    probe = _host(model)
    first = probe.generate_ids(PROMPT, GREEDY, session_id="s0").token_ids
    one_chat = probe.kv_bytes()
    weights = probe.weights_bytes()
    probe.unload()
    assert one_chat > 0

    allowance = int(2.5 * one_chat)  # room for two chats' caches beside the weights
    host = _host(model, budget=weights + allowance)
    for i in range(6):
        host.generate_ids(PROMPT, GREEDY, session_id=f"s{i}")
        # Before each request the others were trimmed to the allowance; the chat that just
        # ran adds its own cache on top (one request's working set).
        assert host.kv_bytes() <= allowance + one_chat
    sessions = host._loaded.sessions
    kept = [sid for sid, chat in sessions.items() if session_kv_bytes(chat)]
    assert "s5" in kept and "s0" not in kept and len(kept) <= 3
    # A chat whose cache was dropped answers exactly as it did with its cache.
    assert host.generate_ids(PROMPT, GREEDY, session_id="s0").token_ids == first
    assert session_kv_bytes(sessions["s0"]) > 0
    host.unload()


def test_without_memory_pressure_every_chat_keeps_its_cache(model):
    host = _host(model)
    for i in range(4):
        host.generate_ids(PROMPT, GREEDY, session_id=f"s{i}")
    assert all(session_kv_bytes(chat) for chat in host._loaded.sessions.values())
    host.unload()


def test_the_recently_used_chat_is_kept_over_an_older_one(model):
    probe = _host(model)
    probe.generate_ids(PROMPT, GREEDY, session_id="x")
    one_chat, weights = probe.kv_bytes(), probe.weights_bytes()
    probe.unload()
    host = _host(model, budget=weights + int(1.5 * one_chat))  # room for one idle chat's cache
    for sid in ("a", "b"):
        host.generate_ids(PROMPT, GREEDY, session_id=sid)
    host.generate_ids(PROMPT + [7], GREEDY, session_id="a")  # "a" used again: "b" is now the oldest
    host.generate_ids(PROMPT, GREEDY, session_id="c")
    sessions = host._loaded.sessions
    assert session_kv_bytes(sessions["a"]) and not session_kv_bytes(sessions["b"])
    host.unload()
