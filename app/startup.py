"""How long the process has been running: the cold-start figure ``--quit-after-show`` prints.

On Linux the kernel records when the process started (``/proc/self/stat``, in clock
ticks since boot), so interpreter start-up and imports are counted too. Elsewhere the
clock starts when this package was first imported, which misses only the interpreter's
own start-up.
"""

from __future__ import annotations

import os
import time

_IMPORTED = time.perf_counter()


def _linux_process_age() -> float | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # Field 22 (starttime) counts after the command name, which may hold spaces.
        fields = stat[stat.rindex(")") + 2 :].split()
        start_ticks = int(fields[19])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def seconds_since_start() -> float:
    age = _linux_process_age()
    return age if age is not None else time.perf_counter() - _IMPORTED
