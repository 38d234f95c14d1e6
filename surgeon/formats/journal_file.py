"""The undo journal of an in-place run, on disk: written and read streaming, trusted only after every check.

    MAGIC | u64 n | n bytes of JSON meta | the old bytes of every range, in order
          | sha256 of each range's old bytes | sha256 of everything before it
    then one record per range, appended (and made durable) just before that range is overwritten:
    b"NEW2" | u32 range | u32 blocks | sha256 of its new bytes | 16-byte sha256 prefix of each block | sha256 of the record

    meta = {"version": 2, "checkpoint": KEY, "index_sha256": hex or null,
            "files": {NAME: {"size": int, "dev": int, "ino": int, "header_sha256": hex}},
            "ranges": [[NAME, offset, length], ...]}

A journal is tied to one state of its files: their identity (size, device, inode), their headers, and
each range's old and new bytes. It is applied only when every range now holds exactly its old or its
new bytes, or, for a write a kill stopped part-way, each 4 KiB block of it does (blocks are aligned in
the weight file: the unit at which the kernel copies a write, and so where a killed one stops).
Nothing here trusts the journal's bytes before they are checked; memory stays bounded by ``CHUNK``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..files.bounded import loads
from .safetensors_header import Header, parse_header

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SUFFIX = ".surgeon-journal"
MAGIC = b"SURGEON-JOURNAL-2\n"
OLD_MAGIC = b"SURGEON-JOURNAL-1\n"
RECORD = b"NEW2"
BLOCK = 4096
CHUNK = 16 << 20  # a multiple of BLOCK: pieces never split a block
_HEAD = len(MAGIC) + 8
_REC_HEAD = 12


@dataclass
class Range:
    file: str
    offset: int
    length: int
    pos: int = 0  # where its old bytes start in the journal
    old: bytes = b""  # sha256 of the old bytes
    new: bytes | None = None  # sha256 of the new bytes, once its record is written
    new_blocks: bytes = b""

    @property
    def blocks(self) -> int:
        return (self.offset + self.length - 1) // BLOCK - self.offset // BLOCK + 1

    def record_size(self) -> int:
        return _REC_HEAD + 32 + 16 * self.blocks + 32


def journal_path(folder: Path, key: str) -> Path:
    """Where the journal of the checkpoint ``key`` (a file or index name) in ``folder`` goes."""
    return folder / f".{key}{SUFFIX}"


def refuse(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} was not applied: {why}. If no surgeon run was interrupted on this checkpoint, delete {path.name}; "
        "if one was, restore the checkpoint from a copy",
        path=path,
    )


def spans(offset: int, length: int, size: int = CHUNK) -> Iterator[tuple[int, int]]:
    """(start, end) file offsets covering [offset, offset + length), cut at the multiples of ``size``."""
    pos, end = offset, offset + length
    while pos < end:
        nxt = min((pos // size + 1) * size, end)
        yield pos, nxt
        pos = nxt


def read_pieces(fd: int, base: int, offset: int, length: int, path: Path) -> Iterator[bytes]:
    """The bytes at ``base`` .. ``base + length`` of ``fd``, cut where the file offsets from ``offset`` are."""
    for start, end in spans(offset, length):
        data = os.pread(fd, end - start, base + start - offset)
        if len(data) != end - start:
            raise CheckpointError(f"{path} ended early: it is truncated")
        yield data


def block_digests(data: ReadableBuffer, offset: int) -> bytes:
    view = memoryview(data).cast("B")
    return b"".join(
        hashlib.sha256(view[a - offset : b - offset]).digest()[:16] for a, b in spans(offset, len(view), BLOCK)
    )


def _write_all(fd: int, data: ReadableBuffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- writing -------------------------------------------------------------------------------------


def write(final: Path, meta: dict, fds: dict[str, int], ranges: list[Range]) -> Path:
    """Save the old bytes of ``ranges`` (read from ``fds``) under a temporary name, make them durable,
    then rename to ``final``. On any failure (a full disk, Ctrl-C) the temporary file is removed."""
    tmp = final.with_name(final.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed run's, never completed: the caller holds the checkpoint's lock
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        digest = hashlib.sha256()
        raw = json.dumps(meta, separators=(",", ":")).encode()
        head = MAGIC + struct.pack("<Q", len(raw)) + raw
        digest.update(head)
        _write_all(fd, head)
        olds = []
        for r in ranges:
            old = hashlib.sha256()
            for piece in read_pieces(fds[r.file], r.offset, r.offset, r.length, final.parent / r.file):
                old.update(piece)
                digest.update(piece)
                _write_all(fd, piece)
            olds.append(old.digest())
        trailer = b"".join(olds)
        digest.update(trailer)
        _write_all(fd, trailer + digest.digest())
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def new_record(index: int, r: Range, data: ReadableBuffer) -> bytes:
    """The record that says range ``index`` is about to hold ``data`` (its new bytes)."""
    view = memoryview(data).cast("B")
    blocks = block_digests(view, r.offset)
    body = RECORD + struct.pack("<II", index, len(blocks) // 16) + hashlib.sha256(view).digest() + blocks
    return body + hashlib.sha256(body).digest()


def append(fd: int, record: bytes) -> None:
    _write_all(fd, record)
    os.fdatasync(fd)


# --- reading -------------------------------------------------------------------------------------


def open_journal(path: Path) -> int:
    """The journal opened for reading: never through a symlink, never blocking, a regular file only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(path, f"it cannot be opened as a regular file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse(path, "it is not a regular file")
    return fd


def read_meta(fd: int, path: Path, limit: int) -> tuple[dict, int]:
    """The journal's JSON meta and its length, read only when the length is within ``limit``."""
    head = os.pread(fd, _HEAD, 0)
    if head.startswith(OLD_MAGIC):
        raise refuse(
            path, "it is damaged or from an older surgeon (format 1 journals cannot be checked against the checkpoint)"
        )
    if len(head) < _HEAD or not head.startswith(MAGIC):
        raise refuse(path, "it is damaged (not a surgeon journal)")
    (n,) = struct.unpack_from("<Q", head, len(MAGIC))
    if n > limit:
        raise refuse(path, f"it is damaged (its range list claims {n} bytes; this checkpoint needs at most {limit})")
    raw = os.pread(fd, n, _HEAD)
    try:
        meta = loads(raw, where="range list")
    except CheckpointError:
        raise refuse(path, "it is damaged (unreadable range list)") from None
    return meta, n


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _hex(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_meta(meta: object, path: Path, key: str, allowed: set[str]) -> tuple[dict[str, dict], list[Range]]:
    """The files and ranges of a journal's meta, every field type-checked; names only from ``allowed``."""
    if not isinstance(meta, dict) or meta.get("version") != 2 or meta.get("checkpoint") != key:
        raise refuse(path, f"it is damaged or not for {key} (version or checkpoint field)")
    files, ranges, index = meta.get("files"), meta.get("ranges"), meta.get("index_sha256")
    if not (index is None or _hex(index)) or not isinstance(files, dict) or not isinstance(ranges, list) or not files:
        raise refuse(path, "it is damaged (malformed files, ranges or index digest)")
    for name, ident in files.items():
        if name not in allowed:
            raise refuse(path, f"it names {name[:80]!r}, which is not a weight file of {key}")
        if not (
            isinstance(ident, dict)
            and all(_int(ident.get(k)) for k in ("size", "dev", "ino"))
            and _hex(ident.get("header_sha256"))
        ):
            raise refuse(path, f"it is damaged (malformed identity of {name})")
    out = []
    for item in ranges:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and item[0] in files
            and _int(item[1])
            and _int(item[2])
            and item[2] > 0
        ):
            raise refuse(path, f"it is damaged (malformed range {json.dumps(item)[:80]})")
        out.append(Range(item[0], item[1], item[2]))
    return files, out


def check_ranges(path: Path, ranges: list[Range], headers: dict[str, Header]) -> None:
    """Each range is a whole tensor's bytes in its file's data section, or that file's header; no two alike."""
    seen: set[tuple[str, int]] = set()
    tensors = {
        f: {
            h.data_start + e["data_offsets"][0]: e["data_offsets"][1] - e["data_offsets"][0]
            for e in h.tensor_entries().values()
        }
        for f, h in headers.items()
    }
    for r in ranges:
        if (r.file, r.offset) in seen:
            raise refuse(path, f"it lists bytes {r.offset}.. of {r.file} twice")
        seen.add((r.file, r.offset))
        header = headers[r.file]
        ok = r.length == header.data_start if r.offset == 0 else tensors[r.file].get(r.offset) == r.length
        if not ok:
            raise refuse(
                path, f"its range {r.offset}+{r.length} of {r.file} is not the bytes of one tensor (nor the header)"
            )


def check_body(fd: int, path: Path, n: int, ranges: list[Range]) -> None:
    """The journal's size against what its ranges allow, then its checksum and each range's old digest
    (streaming), then the records of new bytes; fills in each range's ``pos``, ``old`` and ``new``."""
    pos = _HEAD + n
    for r in ranges:
        r.pos, pos = pos, pos + r.length
    fixed = pos + 32 * len(ranges) + 32
    most = fixed + sum(r.record_size() for r in ranges)
    size = os.fstat(fd).st_size
    if not fixed <= size <= most:
        raise refuse(path, f"it is damaged (it is {size} bytes; its ranges make {fixed} to {most})")
    digest = hashlib.sha256(os.pread(fd, _HEAD + n, 0))
    olds = []
    for r in ranges:
        old = hashlib.sha256()
        for piece in read_pieces(fd, r.pos, r.offset, r.length, path):
            old.update(piece)
            digest.update(piece)
        olds.append(old.digest())
    trailer = os.pread(fd, 32 * len(ranges) + 32, pos)
    digest.update(trailer[:-32])
    if digest.digest() != trailer[-32:] or trailer[:-32] != b"".join(olds):
        raise refuse(path, "it is damaged (checksum mismatch)")
    for r, saved in zip(ranges, olds, strict=True):
        r.old = saved
    _read_records(fd, path, ranges, fixed, size)


def _read_records(fd: int, path: Path, ranges: list[Range], pos: int, size: int) -> None:
    while pos < size:
        head = os.pread(fd, _REC_HEAD, pos)
        if len(head) < _REC_HEAD:
            return  # a record cut short by a crash: its range was not written yet
        tag, index, blocks = head[:4], *struct.unpack("<II", head[4:])
        if tag != RECORD or index >= len(ranges) or ranges[index].new is not None or blocks != ranges[index].blocks:
            raise refuse(path, "it is damaged (a malformed record of new bytes)")
        r, full = ranges[index], _REC_HEAD + 32 + 16 * blocks + 32
        if pos + full > size:
            return
        body = os.pread(fd, full, pos)
        if hashlib.sha256(body[:-32]).digest() != body[-32:]:
            raise refuse(path, "it is damaged (a record of new bytes fails its checksum)")
        r.new, r.new_blocks = body[_REC_HEAD : _REC_HEAD + 32], body[_REC_HEAD + 32 : -32]
        pos += full


def state(path: Path, r: Range, fd: int, jfd: int) -> str:
    """ "old", "new" or "mixed" (a write stopped part-way: each block old or new); refuses anything else."""
    where = f"{r.file} bytes {r.offset}-{r.offset + r.length - 1}"
    now = hashlib.sha256()
    for piece in read_pieces(fd, r.offset, r.offset, r.length, path.parent / r.file):
        now.update(piece)
    if now.digest() == r.old:
        return "old"
    if r.new is not None and now.digest() == r.new:
        return "new"
    if r.new is None:
        raise refuse(
            path, f"{where} no longer hold the bytes it saved, and its run never wrote there: the file changed since"
        )
    k = 0
    cur = read_pieces(fd, r.offset, r.offset, r.length, path.parent / r.file)
    old = read_pieces(jfd, r.pos, r.offset, r.length, path)
    for (start, _), a, b in zip(spans(r.offset, r.length), cur, old, strict=True):
        x, y = block_digests(a, start), block_digests(b, start)
        for i in range(0, len(x), 16):
            if x[i : i + 16] not in (y[i : i + 16], r.new_blocks[k : k + 16]):
                raise refuse(
                    path, f"{where} hold neither the bytes it saved nor those its run wrote: the file changed since"
                )
            k += 16
    return "mixed"


def check_old_header(path: Path, r: Range, jfd: int, now: Header) -> None:
    """A header range may only give back ``__metadata__``: the old header must list the same tensors."""
    raw = os.pread(jfd, r.length, r.pos)
    (length,) = struct.unpack_from("<Q", raw)
    try:
        old = parse_header(path.parent / r.file, length, raw[8:], now.file_size) if length == now.length else None
    except CheckpointError:
        old = None
    if old is None or old.tensor_entries() != now.tensor_entries():
        raise refuse(path, f"the header it saved for {r.file} lists other tensors than the file's own")


def restore(r: Range, fd: int, jfd: int, path: Path) -> None:
    for (start, _), piece in zip(
        spans(r.offset, r.length), read_pieces(jfd, r.pos, r.offset, r.length, path), strict=True
    ):
        os.pwrite(fd, piece, start)
