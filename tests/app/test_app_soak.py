"""The window over a long session (real worker, tiny llama): 500 turns across ten chats.

Per turn it records the process's RSS, the GUI thread's longest stall (the widest gap
between ticks of a 5 ms heartbeat timer, over the whole turn: switching chats, sending,
streaming, saving) and the message widgets alive. A transcript that kept every widget,
re-laid out every message per turn, or a session per chat forever made these grow with
the turns; they must stay flat (least-squares slopes over the second half, after the
warm-up) and the widgets bounded by the screen, not the chat. The stalls themselves stay
under bounds (median, 95th percentile, longest), for turns and, in the window alone, for
switching chats and scrolling."""

from __future__ import annotations

import gc
import os
import time

import pytest

from app.qt import QTimer
from tests.soak import HAS_RSS, block_medians, rss_bytes, slope

pytestmark = [
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.qt_log_ignore("propagateSizeHints"),  # offscreen plugin noise
    pytest.mark.skipif(not HAS_RSS, reason="reads RSS from /proc"),
]

# MLX_DESK_SOAK_TURNS shortens the run to compare stalls before and after a change (the
# slope and memory asserts want the full run).
TURNS = int(os.environ.get("MLX_DESK_SOAK_TURNS", "500"))
CHATS = 10
SETTINGS = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
MAX_LIVE_WIDGETS = 40
RSS_SLOPE = 128 * 1024  # bytes a turn; the report's leak was 970 KB a turn
STALL_SLOPE_MS = 0.5  # per turn, over ten chats: a chat grows by one exchange every ten turns
# The GUI thread's stalls, in ms: (median, 95th percentile, longest). Measured on a 2-core
# CPU machine shared with other test runs, several runs:
#   load 2.4-3.6: a turn (switch, send, stream, save) 23-31 / 36-39 / 68-87; switching chats
#                 19-25 / 23-28 / 84-106 before the collector's full passes were moved off
#                 the long-lived objects (those passes took 60-80 ms each);
#   load 5.5-8.6: a turn 37-44 / 62 / 159-171; switching 28 / 44 / 61; scrolling 22 / 45 / 116.
# Building a screenful at once (the code before) measured, at load 7.7, switching 63 / 100 /
# 123 and scrolling 43 / 69 / 100; the report saw 250 ms. The bounds leave room for a loaded
# CI machine; a turn also shares the CPU with the engine's worker thread.
# Asserted: (median wall-clock stall, the GUI thread's CPU time in a stall for one in twenty,
# and at most); the wall-clock 95th percentile and longest are printed, as they follow the
# machine's load (at load 5-9: a turn's 95th percentile 86-220 ms, longest 324-596 ms, while
# the GUI thread's own work in a stall measured median 19, 95th percentile 29, longest 34 ms
# for a turn; 14 / 22 / 28 switching chats; 13 / 17 / 20 scrolling). With the history
# written on its own thread, the caches' folder read on another and freed widgets refilled,
# the GUI thread's work in a turn's stall measured 6-10 / 10-14 / 13-20 at load 4-6.5 (before:
# 15-23 / 24-31 / 25-44); the wall clock, 20-24 / 40-89 / 86-395 (before: 28-51 / 49-184 /
# 75-360); switching chats 9 / 12 / 22, scrolling 12 / 18 / 21. At load 2-2.5 a turn's wall
# clock measured 12 / 14 / 21 (work 11 / 13 / 14); before, 24 / 32 / 48 (work 21 / 29 / 33).
# A turn's bound on the work is the 50 ms the window promises.
WINDOW_STALLS = (50, 40, 100)
TURN_STALLS = (60, 30, 50)


@pytest.fixture
def frozen():
    """What app.main does once the engine is imported: the objects alive then (modules, the
    engine) are left out of the collector's full passes. Returns the call to make."""
    yield gc.freeze
    gc.unfreeze()


def _quantiles(ms: list[float]) -> tuple[float, float, float]:
    ranked = sorted(ms)
    return ranked[len(ranked) // 2], ranked[min(len(ranked) - 1, int(0.95 * len(ranked)))], ranked[-1]


def _spread(ms: list[float]) -> str:
    median, p95, longest = _quantiles(ms)
    return f"median {median:.0f} ms, 95% {p95:.0f} ms, longest {longest:.0f} ms"


def _assert_smooth(what: str, wall: list[float], busy: list[float], bounds: tuple[float, float, float]) -> None:
    """The median stall as the user sees it (wall clock), and the GUI thread's own work in
    one stall (its CPU time: what another process on the machine cannot inflate) for one
    stall in twenty and beyond (``bounds``: median, 95th percentile, longest)."""
    median, (_, p95, longest) = _quantiles(wall)[0], _quantiles(busy)
    assert median < bounds[0], f"{what}: the median stall is {median:.0f} ms"
    assert p95 < bounds[1], f"{what}: one stall in twenty holds {p95:.0f} ms or more of the GUI thread's work"
    # One stall of hundreds may pass the bound (a full collection or the scheduler can land in
    # any one: a CI run once saw a single 67 ms stall against the 50 ms bound);
    # two, or one past twice the bound, is the window's own cost.
    over = [b for b in busy if b >= bounds[2]]
    assert len(over) <= 1, f"{what}: {len(over)} stalls hold {bounds[2]} ms or more of the GUI thread's work"
    assert longest < 2 * bounds[2], f"{what}: one stall holds {longest:.0f} ms of the GUI thread's work"


class Heartbeat:
    """The widest gap between ticks of a fast timer: how long the GUI thread was busy. Also
    the most CPU time the GUI thread itself spent within one gap (``busiest``): on a machine
    shared with other processes a gap also holds the time the OS gave them, which no code of
    the app can take back; the thread's own CPU time is what the app's code costs."""

    def __init__(self, interval_ms: int = 5):
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.start()
        self.timer.stop()

    def _tick(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.widest = max(self.widest, now - self.last)
        self.busiest = max(self.busiest, cpu - self.last_cpu)
        self.last, self.last_cpu = now, cpu

    def start(self) -> None:
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()
        self.widest = self.busiest = 0.0
        self.timer.start()

    def stop(self) -> float:
        self.timer.stop()
        self._tick()
        return self.widest


def test_500_turns_across_chats_keep_stalls_memory_and_widgets_flat(qtbot, make_window, run_async, tiny_model, frozen):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    frozen()
    chats = []
    for i in range(CHATS):
        cid = window.store.create_conversation()
        window.store.update_conversation(cid, settings=SETTINGS)
        chats.append(cid)
    heartbeat = Heartbeat()
    rss, stalls, busy, live, built, kv, mlx = [], [], [], [], [], [], []
    started = time.monotonic()
    for turn in range(TURNS):
        cid = chats[(turn * 3) % CHATS]  # chats come back in an order that is not round-robin
        heartbeat.start()
        window.open_conversation(cid)
        with qtbot.wait_signal(window.caches.saved, timeout=60_000):
            assert run_async(window.chat.send(f"question {turn}: tell me more"))
        qtbot.wait(1)  # deferred deletes and the window's deferred rebuild
        stalls.append(heartbeat.stop() * 1000)
        busy.append(heartbeat.busiest * 1000)
        rss.append(float(rss_bytes()))
        live.append(window.chat_view.live_widgets)
        built.append(len(window.chat_view.widgets))
        figures = window.gauge.figures  # the engine's MemoryEvent after the reply
        kv.append(float(figures.get("kv_bytes", 0)))
        mlx.append(float(figures.get("active_bytes", 0) + figures.get("cache_bytes", 0)))
    elapsed = time.monotonic() - started
    messages = len(window.store.thread(chats[0]))
    half = slice(TURNS // 2, TURNS)
    stall_trend = slope(block_medians(stalls[half], 25)) / 25  # ms per turn
    rss_trend = slope(rss[half])
    live_trend = slope([float(n) for n in live[half]])
    print(
        f"\nGUI soak: {TURNS} turns in {elapsed:.0f} s, {messages} messages a chat; stall a turn "
        f"{_spread(stalls[half])} (GUI thread's work {_spread(busy[half])}), "
        f"slope {stall_trend * 1000:.1f} us/turn; RSS slope {rss_trend / 1024:.1f} KB/turn "
        f"(MLX active + cache {slope(mlx[half]) / 1024:.1f}, KV {slope(kv[half]) / 1024:.1f}); "
        f"widgets at most {max(live)} alive, {max(built)} built"
    )
    assert messages >= 2 * TURNS // CHATS
    assert max(live) <= MAX_LIVE_WIDGETS and max(built) <= MAX_LIVE_WIDGETS
    assert abs(live_trend) < 0.01
    # The report: the stall grew 21 -> 250 ms over 120 turns of one chat (~2 ms a turn), RSS
    # ~1 MB a turn. Each turn still reads and renders the whole thread once (store, template),
    # a few microseconds a message; a transcript that lays out its messages again costs
    # milliseconds a message.
    assert stall_trend < STALL_SLOPE_MS, f"the GUI stall grows {stall_trend:.3f} ms a turn"
    _assert_smooth("a turn", stalls[half], busy[half], TURN_STALLS)
    # The chats themselves grow (each turn adds ~35 tokens to a live chat's KV cache, ids and
    # rows: ~45 KB a turn measured, flat for the window alone, see below).
    assert rss_trend < RSS_SLOPE, f"RSS grows {rss_trend / 1024:.0f} KB a turn"


def test_switching_chats_and_scrolling_keep_memory_widgets_and_stalls_flat(qtbot, make_window, frozen):
    """The window alone (no engine): opening three 100-message chats in turn and scrolling
    one up and down, RSS does not grow, the widgets stay a screenful, and the GUI thread
    never stalls for long while each screenful is built."""
    window = make_window()
    frozen()
    chats = []
    for _ in range(3):
        cid = window.store.create_conversation()
        parent = None
        for i in range(100):
            role = "user" if i % 2 == 0 else "assistant"
            parent = window.store.add_message(cid, role, f"question {i}: tell me more " * 3, parent, status="complete")
        chats.append(cid)
    view, heartbeat = window.chat_view, Heartbeat()
    rss, live, switch_stalls, scroll_stalls, switch_busy, scroll_busy = [], [], [], [], [], []
    for turn in range(300):
        heartbeat.start()
        window.open_conversation(chats[turn % 3])
        qtbot.waitUntil(lambda: not view.filling)  # the screenful built, pass by pass
        qtbot.wait(1)
        switch_stalls.append(heartbeat.stop() * 1000)
        switch_busy.append(heartbeat.busiest * 1000)
        rss.append(float(rss_bytes()))
        live.append(view.live_widgets)
    bar = view.verticalScrollBar()
    for step in range(300):
        heartbeat.start()
        bar.setValue((step * 997) % max(1, bar.maximum()))  # jumps all over the chat
        qtbot.waitUntil(lambda: not view.filling)
        qtbot.wait(1)
        scroll_stalls.append(heartbeat.stop() * 1000)
        scroll_busy.append(heartbeat.busiest * 1000)
        rss.append(float(rss_bytes()))
        live.append(view.live_widgets)
    switching, scrolling = slope(rss[150:300]), slope(rss[450:])
    print(
        f"\nwindow only: RSS slope {switching / 1024:.2f} KB a switch, {scrolling / 1024:.2f} KB a scroll; "
        f"stalls switching {_spread(switch_stalls)} (work {_spread(switch_busy)}), "
        f"scrolling {_spread(scroll_stalls)} (work {_spread(scroll_busy)})"
    )
    assert switching < 4 * 1024 and scrolling < 4 * 1024
    assert max(live) <= MAX_LIVE_WIDGETS
    _assert_smooth("switching chats", switch_stalls[1:], switch_busy[1:], WINDOW_STALLS)  # the first warms caches
    _assert_smooth("scrolling", scroll_stalls, scroll_busy, WINDOW_STALLS)
