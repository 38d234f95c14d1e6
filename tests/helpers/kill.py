"""Real signals to real surgeon processes, sequenced by what the child says, never by which process is faster.

Two tools:

- ``Interruptible``: a child script that calls ``paused(label)`` at the point to be interrupted. ``paused``
  writes the label on a pipe the test holds and then waits there, without a time limit the test relies on,
  until the test's signal ends the wait (SIGINT raises KeyboardInterrupt, SIGKILL ends the process). The test
  blocks on that pipe, so the signal always lands at that point, however busy the machine is.
- ``kill_at``: ``python -m surgeon ARGS`` SIGKILLed from outside at a wall-clock time. Where such a kill lands
  depends on the machine, so a test may assert only what holds wherever it lands (the input is as it was, the
  output absent or complete); a kill at a known point is ``Interruptible``'s job.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

# Prepended to an ``Interruptible`` script. Ctrl-C raises KeyboardInterrupt as in a terminal, even where the test
# runs in a background job (whose children inherit SIGINT ignored, and Python then leaves it ignored). The wait is
# a loop of short sleeps: Python runs a signal's handler in the main thread between two of them, whichever thread
# the kernel gave the signal to. Past the hang guard it returns, so a stand-in built on it does what it replaces.
PAUSE = textwrap.dedent(
    """
    import os as _os, signal as _signal, time as _time
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)

    def paused(label):
        _os.write(int(_os.environ["SURGEON_TEST_PAUSE_FD"]), label.encode() + b"\\n")
        guard = _time.monotonic() + 600
        while _time.monotonic() < guard:
            _time.sleep(0.01)
    """
)

# Child-script pieces. PAUSE_AFTER_FIRST_TENSOR: an in-place patch writes its first tensor, then ``paused("patching")``,
# then the rest (once per run). RUN_SURGEON: the command line with the script's arguments (after those it took).
PAUSE_AFTER_FIRST_TENSOR = textwrap.dedent(
    """
    import sys
    import surgeon.write.journal as journal
    real_patch, state = journal.patch, {}

    def patch(header, path, start, updates):
        if state:
            return real_patch(header, path, start, updates)
        items = iter(updates)
        done = real_patch(header, path, start, [next(items)])
        state["patching"] = True
        paused("patching")
        return done + real_patch(header, path, start, items)

    journal.patch = patch
    """
)
RUN_SURGEON = textwrap.dedent(
    """
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[1:]]
    main()
    """
)

HANG_GUARD = 600  # seconds: only against a hang, far beyond any run on a busy machine


class Interruptible:
    """``python -c PAUSE+SCRIPT ARGS`` in a child process; ``wait_for(label)`` blocks until the child calls
    ``paused(label)``, then ``send(sig)`` signals it there; ``finish()`` waits for the exit."""

    def __init__(self, script: str, *args: object) -> None:
        read, write = os.pipe()
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        env = dict(os.environ, SURGEON_TEST_PAUSE_FD=str(write), HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PAUSE + textwrap.dedent(script), *map(str, args)],
            stdout=self._out,
            stderr=self._err,
            pass_fds=(write,),
            env=env,
        )
        os.close(write)  # the child's copy alone: its exit closes the pipe, so a read never waits on a dead child
        self._pipe = os.fdopen(read, "rb")

    def wait_for(self, label: str) -> None:
        ready, _, _ = select.select([self._pipe], [], [], HANG_GUARD)
        line = self._pipe.readline().decode().strip() if ready else "(no answer: hang guard)"
        if line != label:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the child never reached {label!r} (it said {line!r}): {self._text(self._err)}")

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def finish(self) -> subprocess.CompletedProcess:
        code = self.proc.wait(timeout=HANG_GUARD)
        self._pipe.close()
        return subprocess.CompletedProcess(self.proc.args, code, self._text(self._out), self._text(self._err))

    @staticmethod
    def _text(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


def duration(args: list[str]) -> float:
    """How long ``python -m surgeon ARGS`` takes here, start to exit (it must succeed)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "surgeon", *args], check=True, capture_output=True, timeout=HANG_GUARD)
    return time.monotonic() - start


def kill_at(args: list[str], at: float) -> bool:
    """``python -m surgeon ARGS``, SIGKILLed ``at`` seconds after its start; whether the kill came before it
    exited on its own."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "surgeon", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        proc.wait(timeout=at)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    return proc.wait(timeout=HANG_GUARD) == -signal.SIGKILL
