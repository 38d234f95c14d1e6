"""One lock per checkpoint: ``flock`` on the resolved real path of every file it holds.

An in-place run (and a recovery) takes the lock exclusively on the checkpoint's index and every shard,
so a run on one shard and a run on its index exclude each other; a copy (``-o``) or ``inspect`` takes it
shared, so it never reads bytes that a patch is changing. Locks are advisory and live on open file
descriptions: nothing is left behind, and a killed run releases them.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

# How long a copy waits for an in-place run on its input to finish before it refuses.
COPY_WAIT_S = 30.0
_POLL_S = 0.05


class Busy(Exception):
    """The lock is held by another run; ``path`` is the file whose lock could not be taken."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def real_paths(paths: Iterable[Path]) -> list[str]:
    """Each file once, by its resolved real path, in a fixed order (so two runs never wait on each other in a cycle)."""
    return sorted({os.path.realpath(p) for p in paths})


@contextmanager
def hold(paths: Iterable[Path], *, exclusive: bool, wait: float = 0.0) -> Iterator[None]:
    """Lock every file of ``paths``; raise :class:`Busy` if some lock is not free within ``wait`` seconds."""
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + wait
    fds: list[int] = []
    try:
        for path in real_paths(paths):
            # O_NONBLOCK: opening a FIFO put where a weight file was expected must not hang
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            fds.append(fd)
            while True:
                try:
                    fcntl.flock(fd, op | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Busy(path) from None
                    time.sleep(_POLL_S)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing the descriptor releases its lock


def is_held(path: Path) -> bool:
    """Whether an exclusive lock (a running in-place job) is held on ``path``; False if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
