"""Model → Machines…: the machines list is kept in the data folder, and checking a machine
runs the engine's probe there (this machine for 127.0.0.1) and shows its versions, free
memory and links; a host that cannot be reached says so and the window goes on."""

from __future__ import annotations

import json

import pytest

from app.controllers.machines import MachinesController, probe_command

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def test_machines_are_checked_and_saved_in_the_data_folder(qtbot, make_window, tmp_path):
    window = make_window(tmp_path / "data")
    menus = [a.menu() for a in window.menuBar().actions() if a.menu() is not None]
    assert any(a.text() == "Machines…" for m in menus for a in m.actions())
    dialog = window.open_machines()
    dialog.host_edit.setText("127.0.0.1")
    dialog.add_button.click()
    qtbot.waitUntil(lambda: "127.0.0.1" in dialog.status, timeout=60_000)
    status = dialog.status["127.0.0.1"]
    assert status.reachable and status.info is not None
    import mlx.core as mx  # the test may: it checks what the probe says against this machine

    assert status.info["mlx"] == mx.__version__ and "ring" in status.info["backends"]
    assert f"MLX {mx.__version__}" in dialog.list.item(0).text() and "GB free" in dialog.list.item(0).text()
    saved = json.loads((tmp_path / "data" / "machines.json").read_text())
    assert saved == {"machines": [{"host": "127.0.0.1"}]}
    assert MachinesController(tmp_path / "data").hosts == ["127.0.0.1"]  # read back, as after a restart

    dialog.host_edit.setText("127.0.0.1")
    dialog.add_button.click()
    assert "already in the list" in dialog.error.text()
    dialog.host_edit.setText("-oProxyCommand=x")
    dialog.add_button.click()
    assert "host name or address" in dialog.error.text()
    dialog.list.setCurrentRow(0)
    dialog.remove_button.click()
    assert json.loads((tmp_path / "data" / "machines.json").read_text()) == {"machines": []}


def test_a_remote_machine_is_probed_over_ssh_without_a_password_prompt():
    command = probe_command("studio-2.local")
    assert command[:2] == ["ssh", "-o"] and "BatchMode=yes" in command and "studio-2.local" in command
    assert command[-1].endswith("-m engine node --probe")
