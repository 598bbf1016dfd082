"""A model too large for this machine, split across it and the saved machines, in the app
(the real worker, two local ranks on a tiny model): the browser says where it fits, the
load starts the ranks and shows each one's progress, the reply is the single process's,
the gauge has one bar per rank, a killed rank leaves one line and a working app, and no
rank outlives the window (checked by pid)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from PySide6.QtCore import Qt

from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise
# Sampling with the request's seed: the split must give the very tokens one process gives.
SEND = {"max_tokens": 12, "seed": 3, "temperature": 0.8}
TOO_SMALL = 4096  # a memory budget no model fits: this machine alone is "too big" for it


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("split") / "tiny-split", layers=4)


def rank_pids() -> list[int]:
    """This process's children that are ranks (``python -m engine node``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"node" in cmdline and b"engine" in cmdline:
            found.append(int(entry.name))
    return found


def gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def send(qtbot, window, text: str):
    window.store.update_conversation(window.chat.conversation_id, settings=SEND)
    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, text)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    return blocker.args[1]


def start_server(qtbot, window) -> str:
    controller = window.server_menu.controller
    controller.port = 0  # the OS picks a free one
    with qtbot.wait_signal(controller.changed, timeout=10_000):
        controller.start()
    return controller.address


def ask_server(address: str) -> tuple[str, str]:
    """A chat reply and a plain completion from the app's server, greedy."""
    with openai.OpenAI(base_url=address, api_key="none", max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(
            model="tiny-split", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}]
        )
        text = client.completions.create(model="tiny-split", prompt="once upon", max_tokens=8, temperature=0)
    return chat.choices[0].message.content, text.choices[0].text


def split_in_browser(window, run_async, model: Path, shard: str = "pipeline"):
    """Open the model browser on ``model`` as this machine's budget cannot hold it."""
    window.machines.add("127.0.0.1")  # a second rank on this machine
    window.machines.set_shard(shard)  # as Machines…'s "Split … by" choice does
    browser = window.open_model_browser()
    browser.budget = TOO_SMALL
    browser.extra_dirs = [str(model.parent)]
    run_async(browser.refresh(), timeout=90_000)
    return browser


def test_a_model_too_big_here_runs_and_serves_across_two_ranks_like_one_process(
    qtbot, make_window, run_async, model, tmp_path
):
    window = make_window(tmp_path / "data")
    assert run_async(window.load_model(str(model)))  # the referee: the same model on one process
    single = send(qtbot, window, "hello there")
    assert window.rank_gauge.isHidden()
    address = start_server(qtbot, window)  # Server → Start server: the same worker's model
    served_single = ask_server(address)
    assert all(served_single)  # words to compare, not two empty replies

    browser = split_in_browser(window, run_async, model)
    row = next(r for r in range(browser.table.rowCount()) if browser.table.item(r, 0).text() == model.name)
    assert browser.table.item(row, browser.table.columnCount() - 1).text() == "✓ fits across 2 machines (pipeline)"
    progress: list[str] = []
    window.models.progress.connect(lambda _d, _t, message: progress.append(message))
    started = time.monotonic()
    assert run_async(window.load_model(str(model)), timeout=90_000)
    loaded_in = time.monotonic() - started
    assert any("rank 0 on 127.0.0.1" in m and "rank 1 on 127.0.0.1" in m for m in progress)
    pids = rank_pids()
    assert len(pids) == 2, pids

    qtbot.waitUntil(lambda: len(window.rank_gauge.ranks) == 2, timeout=10_000)
    assert window.rank_gauge.isVisible() and len(window.rank_gauge.bars) == 2
    ranks = window.rank_gauge.ranks
    assert [r["layers"] for r in ranks] == [[0, 2], [2, 4]]
    assert all(r["weight_bytes"] > 0 for r in ranks)  # measured on each rank
    assert [b.format() for b in window.rank_gauge.bars][1].startswith("rank 1 · 127.0.0.1")

    window.new_chat()  # the same first message as the referee's
    split = send(qtbot, window, "hello there")
    assert split.token_ids == single.token_ids and split.text == single.text
    assert ask_server(address) == served_single  # the server serves the split model like any other

    window.close()  # quitting ends every rank
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids), f"ranks left running: {[p for p in pids if not gone(p)]}"
    print(f"split load {loaded_in:.1f} s")


def test_a_killed_tensor_rank_says_so_in_one_line_and_the_app_loads_on_fewer_machines(
    qtbot, make_window, run_async, model, tmp_path
):
    window = make_window(tmp_path / "data")
    browser = split_in_browser(window, run_async, model, "tensor")
    assert "✓ fits across 2 machines (tensor)" in [
        browser.table.item(r, 6).text() for r in range(browser.table.rowCount())
    ]
    assert run_async(window.load_model(str(model)), timeout=90_000)
    pids = rank_pids()
    assert len(pids) == 2
    qtbot.waitUntil(lambda: [r["layers"] for r in window.rank_gauge.ranks] == [[0, 4], [0, 4]], timeout=10_000)
    window.store.update_conversation(window.chat.conversation_id, settings={**SEND, "max_tokens": 100_000})
    first: list[str] = []
    window.bridge.token.connect(lambda _rid, text, _ch: first.append(text))
    window.composer.edit.setPlainText("tell me everything")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=30_000) as finished:
        window.composer.send_button.click()
        qtbot.waitUntil(lambda: len(first) >= 3, timeout=30_000)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
    assert time.monotonic() - killed < 5.0 + 1.0  # the engine's 5 s, plus the GUI's turn
    qtbot.waitUntil(window.error_banner.isVisible, timeout=5_000)
    line = window.error_banner.text()
    assert "rank 1 on 127.0.0.1 stopped answering" in line and "\n" not in line
    assert finished.args is not None
    qtbot.waitUntil(lambda: all(gone(p) for p in pids), timeout=5_000)
    qtbot.waitUntil(lambda: window.bridge.model_info is None, timeout=5_000)  # the window says: no model
    assert window.rank_gauge.isHidden() and "Select a model" in window.model_button.text()

    window.machines.remove("127.0.0.1")  # the machine is gone: the model on fewer machines
    assert run_async(window.load_model(str(model)), timeout=60_000)
    assert send(qtbot, window, "still there?").stats.generated_tokens >= 1
    assert rank_pids() == []


def test_the_split_is_the_engines_plan_over_each_machines_room(make_window, run_async, model, tmp_path):
    """Machines without room for their share, or not answering, leave the model "too big";
    with room, the fewest machines it fits on, this one named so the others reach it."""
    import socket

    from app.controllers.machines import MachineStatus

    window = make_window(tmp_path / "data")
    machines = window.machines
    machines.add("10.0.0.2")  # never contacted: what its probe said is set below
    roomy, cramped = {"room": 10**9}, {"room": 100_000}  # the plan keeps 64 MB of workspace a rank
    machines.statuses = {"127.0.0.1": MachineStatus("127.0.0.1", True, "", roomy)}
    machines.statuses["10.0.0.2"] = MachineStatus("10.0.0.2", True, "", cramped)
    assert run_async(machines.plan_for(window.bridge, str(model))) is None
    assert machines.fits_across(str(model)) is None and machines.split_for(str(model)) is None
    machines.statuses["10.0.0.2"] = MachineStatus("10.0.0.2", False, "not reachable")
    assert run_async(machines.plan_for(window.bridge, str(model))) is None

    machines.statuses["10.0.0.2"] = MachineStatus("10.0.0.2", True, "", roomy)
    split = run_async(machines.plan_for(window.bridge, str(model)))
    assert split.hosts == [socket.gethostname(), "10.0.0.2"] and split.shard == "pipeline"
    assert len(split.needs) == 2 and all(n > 10**5 for n in split.needs)
    assert machines.fits_across(str(model)) == "✓ fits across 2 machines (pipeline)"
    machines.remove("10.0.0.2")
    assert machines.split_for(str(model)) is None
