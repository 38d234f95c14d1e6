"""Byte copying shared by the formats: untouched bytes are copied, never decoded."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..errors import CheckpointError

_CHUNK = 16 << 20
_KERNEL_CHUNK = 256 << 20  # one copy_file_range call at most: a cancelled copy stops within one chunk


_T = TypeVar("_T")


class Cancelled(Exception):
    """A background copy was stopped because the run failed."""


def copy_range(
    src: BinaryIO, dst: BinaryIO, src_offset: int, dst_offset: int, count: int, *, cancel: threading.Event | None = None
) -> None:
    """Copy ``count`` bytes of file ``src`` at ``src_offset`` to file ``dst`` at ``dst_offset``.

    Kernel-side (``copy_file_range``, reflinks where the file system has them) where possible,
    read/write otherwise. Leaves both files positioned just after the copied range. ``cancel``
    stops the copy (raising :class:`Cancelled`) between chunks.
    """
    dst.flush()
    done = 0
    try:
        while done < count:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            n = os.copy_file_range(
                src.fileno(), dst.fileno(), min(count - done, _KERNEL_CHUNK), src_offset + done, dst_offset + done
            )
            if n == 0:
                break
            done += n
    except OSError:
        pass
    src.seek(src_offset + done)
    dst.seek(dst_offset + done)
    remaining = count - done
    while remaining > 0:
        chunk = src.read(min(remaining, _CHUNK))
        if not chunk:
            raise CheckpointError(f"{src.name} ended early while copying: the file is truncated")
        dst.write(chunk)
        remaining -= len(chunk)


def copy_file_sparse(src: Path, dst: Path) -> None:
    """Copy a file kernel-side where possible; holes of sparse files stay holes."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        pos = 0
        try:
            while pos < size:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
                end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
                copy_range(fin, fout, start, start, end - start)
                pos = end
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole left
                pass
            elif exc.errno in (errno.EINVAL, errno.EOPNOTSUPP) and pos == 0:  # no SEEK_DATA here
                fin.seek(0)
                shutil.copyfileobj(fin, fout, _CHUNK)
            else:
                raise
        fout.truncate(size)


class BackgroundCopies:
    """Byte copies run one after another on a background thread, while the caller computes.

    Kernel-side copies release the GIL, so the copy of a shard overlaps with torch's import and the
    math for the new values. If the ``with`` block fails, pending copies are cancelled before the
    error propagates, so a failed run does not wait for gigabytes it will throw away.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="surgeon-copy")
        self.cancel = threading.Event()

    def submit(self, fn: Callable[..., _T], *args: object) -> Future[_T]:
        return self._pool.submit(fn, *args)

    def __enter__(self) -> BackgroundCopies:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)


def same_bytes(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    """Byte for byte, without filecmp's cache (keyed on size and mtime: a file changed within the same
    tick would compare as before)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True
