"""Byte copying shared by the formats: untouched bytes are copied, never decoded."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..errors import CheckpointError

_CHUNK = 16 << 20


def copy_range(src, dst, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes of file ``src`` at ``src_offset`` to file ``dst`` at ``dst_offset``.

    Kernel-side (``copy_file_range``, reflinks where the file system has them) where possible,
    read/write otherwise. Leaves both files positioned just after the copied range.
    """
    dst.flush()
    done = 0
    try:
        while done < count:
            n = os.copy_file_range(src.fileno(), dst.fileno(), count - done, src_offset + done, dst_offset + done)
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
