"""Byte copying shared by the formats: untouched bytes are copied, never decoded.

Copies run in the kernel (``copy_file_range``; ``FICLONE`` for a whole file), so that on a copy-on-write
file system (XFS with reflink, btrfs) the output shares the source's blocks instead of new ones. A block is
shared only when it is copied whole, from and to offsets that are multiples of :data:`BLOCK`: a range whose
two offsets are the same distance from a block boundary is split there (:func:`copy_range`), and the formats
keep every untouched byte at such an offset (``safetensors.output_header``).

What a run moved is counted (:func:`metered`): bytes written from memory, bytes the kernel copied or shared,
bytes read into memory.
"""

from __future__ import annotations

import contextvars
import errno
import fcntl
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..errors import CheckpointError

_CHUNK = 16 << 20
_KERNEL_CHUNK = 256 << 20  # one copy_file_range call at most: a cancelled copy stops within one chunk
BLOCK = 4096  # the file system block: the unit a copy-on-write file system shares
_FICLONE = 0x40049409  # ioctl(dest, FICLONE, src): dest becomes src, every block shared (linux/fs.h)


_T = TypeVar("_T")


@dataclass(frozen=True)
class IOFigures:
    """What writing an output moved: ``written`` bytes from memory (headers, changed tensors, files copied by
    reading them), ``kernel`` bytes copied by the kernel (on a copy-on-write file system: shared, no new blocks),
    ``read`` bytes read into memory from the weight files (the tensors the math reads, and bytes copied by reading)."""

    written: int = 0
    kernel: int = 0
    read: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"written": self.written, "kernel": self.kernel, "read": self.read}


@dataclass
class Meter:
    """One run's running counts (threads add to it: the background copies, the math's reads)."""

    written: int = 0
    kernel: int = 0
    read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, written: int = 0, kernel: int = 0, read: int = 0) -> None:
        with self._lock:
            self.written += written
            self.kernel += kernel
            self.read += read

    def figures(self) -> IOFigures:
        with self._lock:
            return IOFigures(self.written, self.kernel, self.read)


_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("surgeon_meter", default=None)


@contextmanager
def metered() -> Iterator[Meter]:
    """Count what the copies, writes and reads below (in this context, and in the background copies it
    starts) move."""
    meter = Meter()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def count(*, written: int = 0, kernel: int = 0, read: int = 0) -> None:
    """Add to the running meter, if any."""
    meter = _METER.get()
    if meter is not None:
        meter.add(written=written, kernel=kernel, read=read)


class Cancelled(Exception):
    """A background copy was stopped because the run failed."""


def copy_range(
    src: BinaryIO, dst: BinaryIO, src_offset: int, dst_offset: int, count: int, *, cancel: threading.Event | None = None
) -> None:
    """Copy ``count`` bytes of file ``src`` at ``src_offset`` to file ``dst`` at ``dst_offset``.

    Kernel-side (``copy_file_range``, reflinks where the file system has them) where possible,
    read/write otherwise. Leaves both files positioned just after the copied range. ``cancel``
    stops the copy (raising :class:`Cancelled`) between chunks.

    Where both offsets are the same distance from a block boundary, the range is cut at the first
    boundary: the kernel shares only whole blocks at aligned offsets (a call that starts elsewhere is
    copied, all of it, into new blocks), so the bytes before it are copied alone and the rest shared.
    """
    dst.flush()
    done = 0
    # the first call ends at a block boundary, every later one starts on one (_KERNEL_CHUNK is whole blocks)
    first = -src_offset % BLOCK if (src_offset - dst_offset) % BLOCK == 0 else _KERNEL_CHUNK
    try:
        while done < count:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            step = min(count - done, first or _KERNEL_CHUNK)
            first = 0
            n = os.copy_file_range(src.fileno(), dst.fileno(), step, src_offset + done, dst_offset + done)
            if n == 0:
                break
            done += n
    except OSError:
        pass
    by_kernel = done
    src.seek(src_offset + done)
    dst.seek(dst_offset + done)
    remaining = count - done
    while remaining > 0:
        chunk = src.read(min(remaining, _CHUNK))
        if not chunk:
            raise CheckpointError(f"{src.name} ended early while copying: the file is truncated")
        dst.write(chunk)
        remaining -= len(chunk)
    _count_copy(by_kernel, count - by_kernel)


def _count_copy(kernel: int, by_reading: int) -> None:
    count(kernel=kernel, written=by_reading, read=by_reading)


def clone_file(src: Path, dst: Path, cancel: threading.Event | None = None) -> None:
    """``dst`` becomes a copy of ``src``, never read into memory: cloned (``FICLONE``, every block shared) where
    the file system can, else copied by the kernel (``copy_file_range``), else read and written."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
        except OSError:  # another file system, or not one that clones: copy
            copy_range(fin, fout, 0, 0, size, cancel=cancel)
        else:
            count(kernel=size)


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
        # in the caller's context: the copies count on the caller's meter
        return self._pool.submit(contextvars.copy_context().run, fn, *args)

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
