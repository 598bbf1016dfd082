"""Before Qt starts on Linux: can its platform plugin run here? No Qt imported.

Qt's xcb plugin aborts with a generic "could not load the Qt platform plugin" when one
of the X libraries it links is missing, which tells a new user nothing. The libraries are
looked up the way the dynamic loader finds them, and what is missing is named with the
Debian/Ubuntu packages that carry it and the command that installs them.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable

# Library (as ctypes.util.find_library names it) -> the Debian/Ubuntu package with it.
XCB_LIBRARIES: dict[str, str] = {
    "xcb-cursor": "libxcb-cursor0",
    "xcb-icccm": "libxcb-icccm4",
    "xcb-keysyms": "libxcb-keysyms1",
    "xcb-xinerama": "libxcb-xinerama0",
    "xcb-shape": "libxcb-shape0",
    "xcb-randr": "libxcb-randr0",
    "xcb-render-util": "libxcb-render-util0",
    "xcb-image": "libxcb-image0",
    "xcb-xkb": "libxcb-xkb1",
    "xkbcommon-x11": "libxkbcommon-x11-0",
    "EGL": "libegl1",
    "fontconfig": "libfontconfig1",
}


def _uses_xcb(env: dict[str, str]) -> bool:
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(":")[0] == "xcb"
    # Qt picks Wayland when a Wayland session is there, else X11.
    return not env.get("WAYLAND_DISPLAY")


def display_problem(
    env: dict[str, str] | None = None,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
    platform: str = sys.platform,
) -> str | None:
    """One line saying why Qt's window cannot start here, or None when it should."""
    env = dict(os.environ) if env is None else env
    if not platform.startswith("linux") or not _uses_xcb(env):
        return None
    missing = [pkg for lib, pkg in XCB_LIBRARIES.items() if find_library(lib) is None]
    if missing:
        return (
            f"The window needs X libraries that are missing: {', '.join(missing)}. "
            f"Install them with: sudo apt-get install {' '.join(missing)}"
        )
    if not env.get("DISPLAY"):
        return "No display to open a window on (DISPLAY is not set): start MLX Desk from a desktop session."
    return None
