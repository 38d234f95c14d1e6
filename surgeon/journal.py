"""In-place patching of safetensors checkpoints, made crash safe by an undo journal.

``surgeon reinit --in-place`` on safetensors rewrites only the byte ranges of the re-initialized
tensors (and the header, when surgeon's record fits in its existing length), instead of the whole
checkpoint. Before the first byte changes, the original bytes of every range are written to a
journal beside the checkpoint and made durable:

    .<name>.surgeon-journal      MAGIC | u64 n | n bytes of JSON {"ranges": [[file, offset, length], ...]}
                                 | the original bytes of each range | sha256 of everything before it

The journal is written under a temporary name and renamed once complete and fsynced, so a journal
under its final name is always whole. After the patch is fsynced, the journal is removed. A run that
dies in between leaves the journal, and the next surgeon command that opens the checkpoint (or
``surgeon recover PATH``) writes the original bytes back: the checkpoint is then exactly as before.
A lock (``flock`` on the checkpoint's file, or its index) keeps two runs, or a run and a recovery, apart.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .errors import CheckpointError, OutputError, opt
from .formats.safetensors import Header, SafetensorsWeights, add_record, encode_header, patch, with_metadata

if TYPE_CHECKING:
    from .formats.base import UpdatesFn
    from .source import Source

MAGIC = b"SURGEON-JOURNAL-1\n"
SUFFIX = ".surgeon-journal"
_CHUNK = 16 << 20


def journal_path(folder: Path, key: str) -> Path:
    return folder / f".{key}{SUFFIX}"


@contextmanager
def _locked(folder: Path, key: str, *, wait: bool = False) -> Iterator[bool]:
    """An exclusive lock for in-place work on the checkpoint ``key`` in ``folder``; yields False if held.

    The lock is taken on the checkpoint's own file (advisory: readers are not blocked), so that no
    lock file is left behind.
    """
    fd = os.open(folder / key, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_journal(folder: Path, key: str, ranges: list[tuple[str, int, int]]) -> Path:
    """Save the original bytes of ``ranges`` durably; returns the journal's path."""
    final = journal_path(folder, key)
    tmp = final.with_name(final.name + ".tmp")
    digest = hashlib.sha256()
    meta = json.dumps({"ranges": [list(r) for r in ranges]}).encode()
    with open(tmp, "wb") as out:

        def put(data: bytes) -> None:
            digest.update(data)
            out.write(data)

        put(MAGIC + struct.pack("<Q", len(meta)) + meta)
        for file, offset, length in ranges:
            with open(folder / file, "rb") as src:
                src.seek(offset)
                left = length
                while left:
                    chunk = src.read(min(left, _CHUNK))
                    if not chunk:
                        raise CheckpointError(f"{folder / file} ended early while journaling: the file is truncated")
                    put(chunk)
                    left -= len(chunk)
        out.write(digest.digest())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)
    _fsync_dir(folder)
    return final


def _read_journal(path: Path) -> list[tuple[str, int, bytes]]:
    """The (file, offset, original bytes) a journal holds; raises CheckpointError if it is damaged."""
    data = path.read_bytes()
    body, digest = data[:-32], data[-32:]
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8 + 32 or hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is damaged (checksum mismatch); the checkpoint beside it may be half-patched: restore it from a copy, then delete {path.name}")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        ranges = json.loads(body[start : start + n])["ranges"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path} is damaged (unreadable range list)") from None
    out, pos = [], start + n
    for file, offset, length in ranges:
        if "/" in file or "\\" in file or file in (".", ".."):
            raise CheckpointError(f"{path} names {file!r}, which is not a file beside it; delete the journal")
        out.append((file, int(offset), body[pos : pos + length]))
        pos += length
    return out


def _roll_back(folder: Path, journal: Path) -> list[str]:
    entries = _read_journal(journal)
    files = sorted({f for f, _, _ in entries})
    handles = {f: os.open(folder / f, os.O_WRONLY) for f in files}
    try:
        for file, offset, original in entries:
            os.pwrite(handles[file], original, offset)
        for fd in handles.values():
            os.fsync(fd)
    finally:
        for fd in handles.values():
            os.close(fd)
    journal.unlink()
    _fsync_dir(folder)
    return files


def recover(path: str | Path) -> list[str]:
    """Roll back in-place runs on the checkpoint at ``path`` (a file or folder) that did not finish.

    Returns one note per journal handled (an empty list when there was nothing to do). A journal
    whose run is still going (its lock is held) is left alone.
    """
    path = Path(path)
    folder, pattern = (path, "*") if path.is_dir() else (path.parent, glob.escape(path.name))
    notes = []
    for leftover in sorted(folder.glob(f".{pattern}{SUFFIX}.tmp")):  # never complete, so nothing was patched yet
        key = leftover.name[1 : -len(SUFFIX + ".tmp")]
        if (folder / key).is_file():
            with _locked(folder, key) as mine:
                if mine:
                    leftover.unlink(missing_ok=True)
    for journal in sorted(folder.glob(f".{pattern}{SUFFIX}")):
        key = journal.name[1 : -len(SUFFIX)]
        if not (folder / key).is_file():
            raise CheckpointError(f"{journal} belongs to {key}, which is missing; restore {key} or delete the journal")
        with _locked(folder, key) as mine:
            if not mine:
                notes.append(f"an in-place run on {folder / key} is in progress (journal {journal.name}); not touched")
                continue
            if not journal.exists():
                continue
            files = _roll_back(folder, journal)
            notes.append(f"rolled back an interrupted in-place run: {', '.join(files)} in {folder} are as they were before it")
    return notes


def patch_in_place(source: Source, updates: UpdatesFn, record: dict) -> list[str]:
    """Patch the changed tensors of a safetensors checkpoint in place, journaled; returns notes."""
    weights = cast(SafetensorsWeights, source.primary)  # --in-place is for safetensors only (api)
    folder = weights.folder
    key = weights.index or weights.files[0]
    changed = _changed_files(weights, updates)
    if not changed:
        return []
    notes: list[str] = []
    with _locked(folder, key) as mine:
        if not mine:
            raise OutputError(f"another surgeon run is patching {folder / key} in place; wait for it to finish")
        headers: dict[str, bytes | None] = {}
        ranges: list[tuple[str, int, int]] = []
        for file, names in changed.items():
            header = weights.headers[file]
            headers[file] = _header_in_place(header, record)
            if headers[file] is not None:
                ranges.append((file, 0, header.data_start))
            for name in names:
                begin, end = header.entries[name]["data_offsets"]
                ranges.append((file, header.data_start + begin, end - begin))
        # The journal is written (and fsynced) on a background thread while torch loads and the first
        # new value is computed; nothing is patched before it is durable. Each value is then written
        # as soon as it is computed, so one is in memory at a time.
        with ThreadPoolExecutor(1, thread_name_prefix="surgeon-journal") as pool:
            durable = pool.submit(_write_journal, folder, key, ranges)
            try:
                _patch_files(weights, changed, headers, updates, durable)
            except BaseException:
                # A failure part-way (a refused head, a full disk, Ctrl-C) is rolled back at once from
                # the journal, so the input is as it was; if the journal itself failed, nothing was patched.
                if durable.exception() is None:
                    _roll_back(folder, durable.result())
                raise
            journal = durable.result()
        journal.unlink()
        _fsync_dir(folder)
    skipped = [f for f in changed if headers[f] is None]
    if skipped:
        notes.append(
            f"surgeon's record was not added to the header of {', '.join(skipped)}: it does not fit without moving every "
            f"tensor, and {opt('in_place', True)} rewrites only the changed bytes (write a copy with {opt('output')} to get the record)"
        )
    return notes


def _patch_files(weights, changed: dict[str, list[str]], headers: dict[str, bytes | None], updates, durable) -> None:
    def after_journal(items):
        for item in items:
            durable.result()  # nothing is written before the journal is durable
            yield item

    for file in changed:
        header = weights.headers[file]
        path = weights.folder / file
        written = patch(header, path, header.data_start, after_journal(updates(file)))
        if set(written) != set(changed[file]):
            raise AssertionError(f"in-place patch of {file} is missing {sorted(set(changed[file]) - set(written))[:3]}")
        with open(path, "r+b") as out:
            durable.result()
            new_header = headers[file]
            if new_header is not None:
                os.pwrite(out.fileno(), new_header, 0)
            os.fsync(out.fileno())


def _changed_files(weights, updates) -> dict[str, list[str]]:
    """file -> tensors of the plan in it, in file order (``updates.names``: the plan's tensors)."""
    wanted = updates.names
    out: dict[str, list[str]] = {}
    for name, info in weights.tensors.items():
        if name in wanted:
            out.setdefault(info.file, []).append(name)
    return out


def _header_in_place(header: Header, record: dict) -> bytes | None:
    """The header with the record added, padded to its current length; None if it does not fit."""
    raw = encode_header(with_metadata(header.entries, add_record(header.metadata, record)))
    if len(raw) > header.length:
        return None
    return struct.pack("<Q", header.length) + raw + b" " * (header.length - len(raw))
