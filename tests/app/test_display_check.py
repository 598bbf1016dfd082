"""Before Qt starts: a missing X library or display is one line naming the fix."""

from __future__ import annotations

import subprocess
import sys

from app.display_check import XCB_LIBRARIES, display_problem


def _finder(missing: set[str]):
    return lambda lib: None if lib in missing else f"lib{lib}.so"


def test_missing_xcb_libraries_are_named_with_the_apt_command():
    line = display_problem({"DISPLAY": ":0"}, _finder({"xcb-cursor", "xcb-icccm"}), "linux")
    assert line == (
        "The window needs X libraries that are missing: libxcb-cursor0, libxcb-icccm4. "
        "Install them with: sudo apt-get install libxcb-cursor0 libxcb-icccm4"
    )
    assert "\n" not in line


def test_nothing_to_say_when_qt_can_start():
    assert display_problem({"DISPLAY": ":0"}, _finder(set()), "linux") is None
    assert display_problem({}, _finder(set(XCB_LIBRARIES)), "darwin") is None  # not X11
    # Another platform plugin (the tests' offscreen one, Wayland) needs no X libraries.
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, _finder(set(XCB_LIBRARIES)), "linux") is None
    assert display_problem({"WAYLAND_DISPLAY": "wayland-0"}, _finder(set(XCB_LIBRARIES)), "linux") is None


def test_no_display_is_said_once_the_libraries_are_there():
    assert "DISPLAY is not set" in display_problem({}, _finder(set()), "linux")


def test_the_app_prints_the_line_and_exits_before_qt(tmp_path):
    """With the X platform chosen and no display, mlx-desk says why in one line."""
    env = {"PATH": "/usr/bin:/bin", "QT_QPA_PLATFORM": "xcb", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "app.main", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and ("apt-get install" in lines[0] or "DISPLAY is not set" in lines[0])
