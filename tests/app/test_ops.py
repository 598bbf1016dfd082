"""app.ops.Op: work on a helper thread, its outcome and progress on the GUI thread.

Real threads and Qt's real queued delivery; the work is plain Python (no engine).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from app import ops, tasks
from app.qt import QObject


def _pending(op: ops.Op) -> bool:
    """Whether app.tasks still counts ``op`` (other tests' tasks may be pending too)."""
    return op in tasks._running


def _on_gui_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def test_awaited_op_returns_the_value_from_another_thread(run_async):
    ran_on: list[threading.Thread] = []

    def work(a: int, b: int) -> int:
        ran_on.append(threading.current_thread())
        return a + b

    async def go() -> int:
        return await ops.Op(work, 2, b=3)

    assert run_async(go()) == 5
    assert ran_on and ran_on[0] is not threading.main_thread()
    assert ran_on[0].daemon  # quitting never waits on it


def test_awaited_op_raises_the_work_s_exception(run_async):
    def work() -> None:
        raise OSError("disk gone")

    async def go() -> str:
        try:
            await ops.Op(work)
        except OSError as exc:
            return str(exc)
        return "no exception"

    assert run_async(go()) == "disk gone"


def test_success_and_progress_run_on_the_gui_thread_in_order(qtbot, aloop):
    seen: list[tuple[str, object, bool]] = []

    def work(n: int, progress) -> str:
        for i in range(n):
            progress(i + 1, n)
        return "done"

    op = (
        ops.Op(work, 3)
        .with_progress(lambda done, total: seen.append(("progress", (done, total), _on_gui_thread())))
        .success(lambda value: seen.append(("success", value, _on_gui_thread())))
    )
    op.run()
    qtbot.waitUntil(lambda: any(kind == "success" for kind, _, _ in seen), timeout=10_000)
    assert seen == [
        ("progress", (1, 3), True),
        ("progress", (2, 3), True),
        ("progress", (3, 3), True),
        ("success", "done", True),
    ]
    assert not _pending(op)


def test_failure_goes_to_its_callback_or_else_to_the_status_bar(qtbot, aloop, monkeypatch, capsys):
    caught: list[Exception] = []
    ops.Op(int, "not a number").failure(caught.append).run()
    qtbot.waitUntil(lambda: bool(caught), timeout=10_000)
    assert isinstance(caught[0], ValueError)

    reported: list[str] = []
    monkeypatch.setattr(tasks, "_reporter", reported.append)
    ops.Op(int, "still not").success(lambda _: None).run()
    qtbot.waitUntil(lambda: bool(reported), timeout=10_000)
    assert reported[0].startswith("Something went wrong: invalid literal for int()")
    assert "ValueError" in capsys.readouterr().err  # and the traceback in the log


def test_nothing_follows_once_the_owner_is_deleted(qtbot, aloop):
    owner = QObject()
    release = threading.Event()
    called: list[object] = []
    op = ops.Op(release.wait, 10).success(called.append)
    future = op.run(owner)
    owner.deleteLater()
    qtbot.waitUntil(lambda: not ops._alive(owner), timeout=10_000)
    release.set()
    future.result(timeout=10)
    qtbot.waitUntil(lambda: not _pending(op), timeout=10_000)  # settled, silently
    assert called == []


def test_the_pool_bounds_its_threads_and_reuses_them(qtbot, aloop):
    gate = threading.Event()
    threads: set[int] = set()
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            threads.add(threading.get_ident())
        gate.wait(10)
        return i

    done: list[int] = []
    for i in range(ops.MAX_THREADS + 6):
        ops.Op(work, i).success(done.append).run()
    time.sleep(0.2)
    with lock:
        # Side by side, but never more than the bound (the rest wait their turn); an earlier
        # test's work still under way may hold a thread or two.
        assert 2 <= len(threads) <= ops.MAX_THREADS
        assert ops._pool._threads <= ops.MAX_THREADS
    gate.set()
    qtbot.waitUntil(lambda: len(done) == ops.MAX_THREADS + 6, timeout=10_000)
    assert sorted(done) == list(range(ops.MAX_THREADS + 6))
    assert len(threads) <= ops.MAX_THREADS  # the waiting work ran on the same threads


def test_watching_a_future_another_thread_runs(qtbot, run_async):
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    threading.Timer(0.05, future.set_result, ("written",)).start()

    async def go() -> tuple[str | None, None]:
        return await ops.Op.of_future(future), await ops.Op.of_future(None)

    assert run_async(go()) == ("written", None)

    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(OSError("full"))
    caught: list[Exception] = []
    ops.Op.of_future(failed).failure(caught.append).run()
    qtbot.waitUntil(lambda: bool(caught), timeout=10_000)
    assert str(caught[0]) == "full"


@pytest.mark.parametrize("count", [1, 4])
def test_tasks_pending_counts_ops_until_their_callbacks_ran(qtbot, aloop, count):
    gate = threading.Event()
    started = [ops.Op(gate.wait, 10).success(lambda _: None) for _ in range(count)]
    before = tasks.pending()
    for op in started:
        op.run()
    assert all(_pending(op) for op in started) and tasks.pending() >= before + count
    gate.set()
    qtbot.waitUntil(lambda: not any(_pending(op) for op in started), timeout=10_000)
