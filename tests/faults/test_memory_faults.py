"""KV caches of chats out of use are given back, least recently used first, when the
budget leaves no room: memory stays within the budget, and a chat whose cache was dropped
answers exactly as before when it comes back."""

from __future__ import annotations

import pytest

from engine.api import GenerationParams
from engine.runtime.host import ModelHost
from engine.runtime.kv_eviction import session_kv_bytes
from tests.soak import HAS_RSS, rss_bytes, slope
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


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(not HAS_RSS, reason="reads RSS from /proc")
def test_soak_500_turns_across_chats_keeps_memory_flat(model):
    """500 turns over 25 chats under a budget with room for a few caches: the KV bytes stay
    within the budget and neither they nor the process's RSS grow with the turns (a slope
    against turns, measured over the second half, after the warm-up)."""
    import mlx.core as mx

    probe = _host(model)
    probe.generate_ids(PROMPT, GREEDY, session_id="x")
    one_chat, weights = probe.kv_bytes(), probe.weights_bytes()
    probe.unload()
    allowance = 4 * one_chat
    host = _host(model, budget=weights + allowance)
    kv, rss, active = [], [], []
    history: dict[str, list[int]] = {}
    for turn in range(500):
        sid = f"chat-{(turn * 7) % 25}"  # chats come back in an order that is not round-robin
        ids = history.get(sid, list(range(5, 60)))
        ids = (ids + [(turn % 200) + 5] * 3)[-300:]  # each turn adds to its chat, within the window
        result = host.generate_ids(ids, GREEDY, session_id=sid)
        history[sid] = ids + result.token_ids
        kv.append(host.kv_bytes())
        rss.append(rss_bytes())
        active.append(mx.get_active_memory())
        assert kv[-1] <= allowance + 2 * one_chat, f"turn {turn}: KV {kv[-1]} past the budget"
    half = slice(250, 500)
    rss_slope = slope([float(v) for v in rss[half]])
    kv_slope = slope([float(v) for v in kv[half]])
    active_slope = slope([float(v) for v in active[half]])
    print(
        f"\nsoak: RSS slope {rss_slope / 1024:.1f} KB/turn, KV slope {kv_slope / 1024:.2f} KB/turn, "
        f"MLX active slope {active_slope / 1024:.2f} KB/turn, KV at most {max(kv) / 1024:.0f} KB"
    )
    assert abs(kv_slope) < one_chat / 100  # under 2.5 chats' caches over the whole half
    assert rss_slope < 64 * 1024  # under 64 KB a turn (the app's reported leak was 970 KB)
    assert active_slope < one_chat / 100
    host.unload()
