"""App fixtures: a tiny real model, a qasync loop inside pytest-qt, a window on a temp data dir.

The engine is the real one (EngineWorker on its own thread); only the model is tiny.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def aloop(qapp):
    """An asyncio loop that runs on Qt's event loop, as in the app (qasync)."""
    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.set_event_loop(loop)
    yield loop
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)
    loop._after_run_forever()  # the counterpart of already_running's setup


@pytest.fixture
def run_async(qtbot, aloop):
    """Run a coroutine to completion while Qt keeps processing events."""

    def run(coro, timeout: int = 60_000):
        task = asyncio.ensure_future(coro, loop=aloop)
        qtbot.waitUntil(task.done, timeout=timeout)
        return task.result()

    return run


@pytest.fixture
def make_window(qtbot, aloop, tmp_path):
    """Build MainWindows over a real engine; each is closed (engine shut down) at the end."""
    from app.bridge import EngineBridge
    from app.store import HistoryStore
    from app.ui.main_window import MainWindow

    made = []

    def make(data_dir: Path | None = None):
        store = HistoryStore(data_dir or tmp_path / "data")
        bridge = EngineBridge()
        window = MainWindow(store, bridge)
        qtbot.addWidget(window)
        window.show()
        made.append((window, store))
        return window

    yield make
    for window, store in made:
        window.close()
        store.close()


@pytest.fixture
def hold_worker(qtbot):
    """Keep a window's worker busy with a long generation (on a session no chat shows), so a
    load queued behind it stays "loading" until the returned function stops it."""
    from app.tasks import spawn
    from engine import api

    def hold(window):
        started: list[int] = []
        window.bridge.token.connect(lambda rid, *_: started.append(rid))
        task = spawn(
            window.bridge.generate(
                "hold",
                [{"role": "user", "content": "go on"}],
                api.GenerationParams(max_tokens=100_000, ignore_eos=True),
            )
        )
        qtbot.waitUntil(lambda: bool(started), timeout=30_000)

        def release():
            window.bridge.cancel(started[0])
            qtbot.waitUntil(task.done, timeout=30_000)

        return release

    return hold
