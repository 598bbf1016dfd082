"""One app per data folder: a second instance hands its files to the first and leaves the
history alone."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.single_instance import SingleInstance, server_name
from app.store import HistoryStore

ROOT = Path(__file__).resolve().parents[2]


def test_the_second_claim_hands_its_files_to_the_first(qtbot, tmp_path):
    first = SingleInstance(tmp_path)
    assert first.claim()
    second = SingleInstance(tmp_path / ".")  # the same folder, spelled differently
    picture = tmp_path / "photo.png"
    with qtbot.wait_signal(first.files_received, timeout=5000) as blocker:
        assert not second.claim([str(picture)], "some/model")
    assert blocker.args == [[str(picture.resolve())], "some/model"]
    first.close()


@pytest.mark.qt_log_ignore("propagateSizeHints", "does not support raise")  # offscreen plugin
def test_the_running_window_comes_forward_with_the_files(qtbot, make_window, run_async, tmp_path):
    from app.qt import QImage
    from app.single_instance import bring_forward

    window = make_window()
    window.showMinimized()
    picture = tmp_path / "cat.png"
    image = QImage(8, 8, QImage.Format.Format_RGB32)
    image.fill(0x336699)
    image.save(str(picture))
    window.composer.set_capabilities(image=True, audio=False)
    bring_forward(window, [str(picture)])
    qtbot.waitUntil(lambda: window.composer.attachments == [("image", str(picture))], timeout=10_000)
    assert not window.isMinimized()


def test_another_folder_is_another_app(qtbot, tmp_path):
    a, b = SingleInstance(tmp_path / "a"), SingleInstance(tmp_path / "b")
    assert server_name(tmp_path / "a") != server_name(tmp_path / "b")
    assert a.claim() and b.claim()
    a.close()
    b.close()


def test_a_socket_left_by_a_crash_does_not_block_the_next_start(qtbot, tmp_path):
    from app.qt import QLocalServer

    stale = QLocalServer()
    assert stale.listen(server_name(tmp_path))
    stale.close()  # closed without removal of the name is what a killed process leaves on Unix
    again = SingleInstance(tmp_path)
    assert again.claim()
    again.close()


FIRST = textwrap.dedent("""
    import sys
    from app.qt import QApplication, QTimer
    from app.single_instance import SingleInstance
    app = QApplication([])
    first = SingleInstance(sys.argv[1])
    assert first.claim()
    first.files_received.connect(lambda files, model: (print("got", files, model, flush=True), app.quit()))
    print("listening", flush=True)
    QTimer.singleShot(60_000, app.quit)
    app.exec()
""")


@pytest.mark.slow
def test_a_second_app_on_the_same_folder_is_refused_and_leaves_the_history_alone(tmp_path):
    data = tmp_path / "data"
    store = HistoryStore(data)
    conv = store.create_conversation("live")
    live = store.add_message(conv, "assistant", "half a reply", None, status="streaming")
    store.close()
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", FIRST, str(data)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline().strip() == "listening"
        picture = tmp_path / "cat.png"
        picture.write_bytes(b"")
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "app.main", "--data-dir", str(data), str(picture)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=ROOT,
        )
        took = time.monotonic() - started
        assert second.returncode == 0
        assert "already running" in second.stderr and second.stderr.count("\n") == 1
        assert first.stdout.readline().startswith(f"got ['{picture}']")
        assert took < 60
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
    # Read without HistoryStore: its start-up pass is what must not have run.
    db = sqlite3.connect(data / "history.sqlite3")
    assert db.execute("SELECT status FROM messages WHERE id=?", (live,)).fetchone()[0] == "streaming"
    db.close()
