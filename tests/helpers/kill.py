"""Real kill -9 of a surgeon process, timed by what it is seen doing on disk.

A calibration run, watched from outside, says when writing starts and ends on this machine; the kills
are then set inside that window, relative to the moment writing is seen to start, so that a slow start
(a busy machine, a cold import) does not move them out of it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

Probe = Callable[[dict], bool]


def watch(
    args: list[str],
    probes: dict[str, Probe],
    *,
    kill_at: float | None = None,
    kill_after: tuple[str, float] | None = None,
) -> dict:
    """Run ``python -m surgeon ARGS`` in a child process and poll ``probes`` (in order, each given the times
    seen so far) until it exits; the time (seconds from the start) each probe is first true is recorded
    under its name (None: never seen). SIGKILLed ``kill_at`` seconds after the start, or, with
    ``kill_after=(name, s)``, ``s`` seconds after probe ``name`` was first seen. ``killed``: whether the
    kill came before the child exited on its own."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "surgeon", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    seen: dict = dict.fromkeys(probes) | {"killed": False}
    while proc.poll() is None:
        now = time.monotonic() - start
        for name, probe in probes.items():
            if seen[name] is None and probe(seen):
                seen[name] = now
        due = kill_at
        if kill_after is not None and seen[kill_after[0]] is not None:
            due = seen[kill_after[0]] + kill_after[1]
        if due is not None and now >= due:
            proc.send_signal(signal.SIGKILL)
            seen["killed"] = proc.wait() == -signal.SIGKILL
            break
        time.sleep(0.0005)
    proc.wait(timeout=600)  # a hang guard only
    return seen
