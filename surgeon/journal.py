"""In-place patching of safetensors checkpoints, made crash safe by an undo journal.

``surgeon reinit --in-place`` on safetensors rewrites only the byte ranges of the re-initialized
tensors (and the header, when surgeon's record fits in its existing length), instead of the whole
checkpoint. Before the first byte changes, the old bytes of every range are saved to a journal beside
the checkpoint (``.<name>.surgeon-journal``, format in :mod:`surgeon.journal_file`) and made durable;
the digest of each range's new bytes is appended just before that range is written. After the patch
is fsynced, the journal is removed.

A run that dies in between leaves the journal. Only ``surgeon recover PATH`` (and the next ``--in-place``
run on the same checkpoint) rolls it back, and only after checking it belongs to the files as they are
now: same files (size, device, inode), same headers, every range exactly one tensor's bytes (or the
header) and holding its old or its new bytes. Every other command refuses a checkpoint with a journal
and names ``surgeon recover``: a half-patched checkpoint is never read, copied or pushed.

One lock per checkpoint (:mod:`surgeon.locks`) on the index and every shard: exclusive for in-place
runs and recoveries, shared for copies and ``inspect``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from . import journal_file as jf
from . import locks
from .errors import CheckpointError, OutputError, opt
from .formats.safetensors import (
    INDEX_SUFFIX,
    Header,
    SafetensorsWeights,
    add_record,
    encode_header,
    patch,
    read_header_fd,
    with_metadata,
)

if TYPE_CHECKING:
    from .formats.base import UpdatesFn
    from .source import Source

SUFFIX = ".surgeon-journal"
_MAX_INDEX = 64 << 20


def journal_path(folder: Path, key: str) -> Path:
    return folder / f".{key}{SUFFIX}"


class HalfPatchedError(OutputError):
    """A failed or interrupted in-place run could not be rolled back: the journal is kept for ``surgeon recover``."""


# --- finding journals (by name only: nothing is opened or followed) -------------------------------


def find_journals(path: Path, *, unfinished: bool = False, own: bool = False) -> list[tuple[str, Path]]:
    """(checkpoint name, journal) for the journals that concern ``path``; with ``unfinished`` also the
    temporary ones of runs that died while writing them. A file's own, and any index's (it may list
    the file; not with ``own``); for a folder or an index, every one in its folder."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    every = path.is_dir() or path.name.endswith(".index.json")
    found = []
    for name in names:
        for suffix in (SUFFIX, SUFFIX + ".tmp") if unfinished else (SUFFIX,):
            key = name[1 : -len(suffix)] if name.startswith(".") and name.endswith(suffix) else ""
            if key and (every or key == path.name or (key.endswith(".index.json") and not own)):
                found.append((key, folder / name))
    return found


def refuse_journals(path: Path, *, unfinished: bool = False) -> None:
    """One line, if an in-place run on the checkpoint at ``path`` is going on or did not finish."""
    found = find_journals(path, unfinished=unfinished)
    if not found:
        return
    key, journal = found[0]
    target = journal.parent / key
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if locks.is_held(target):
        raise OutputError(f"an in-place run is patching {target} right now (journal {journal.name}{more}); run this again when it has finished")
    raise CheckpointError(
        f"{journal}{more} is left by an in-place run on {target} that did not finish, so the weights may be half-patched; "
        f"run `surgeon recover {target}` first (it checks the journal, then rolls back)",
        path=journal,
    )


# --- the files of a checkpoint, opened safely ----------------------------------------------------


def open_file(path: Path, *, write: bool) -> int:
    """A weight file opened without following a link and without blocking; a regular file with one link only."""
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "it is a symbolic link" if os.path.islink(path) else exc.strerror or str(exc)
        raise CheckpointError(f"cannot open {path} for an in-place patch or its rollback: {why}", path=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"it has {st.st_nlink} hard links"
        raise CheckpointError(f"cannot patch {path} in place or roll it back: {why}", path=path)
    return fd


def _read_small(path: Path) -> bytes:
    fd = open_file(path, write=False)
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_INDEX:
            raise CheckpointError(f"index {path} is {size} bytes: too large for an index file", path=path)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def checkpoint_files(folder: Path, key: str) -> list[str]:
    """The weight files of the checkpoint ``key``: itself, or the shards its own index names (plain names)."""
    if not os.path.lexists(folder / key):
        raise CheckpointError(f"a journal in {folder} belongs to {key}, which is missing; restore {key} or delete the journal")
    if not key.endswith(INDEX_SUFFIX):
        if not key.endswith(".safetensors"):
            raise CheckpointError(f"a journal in {folder} names {key}, which is not a safetensors checkpoint; surgeon never wrote it")
        return [key]
    try:
        weight_map = json.loads(_read_small(folder / key))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CheckpointError(f"cannot read index {folder / key}: expected JSON with a 'weight_map'", path=folder / key) from None
    for shard in shards:
        if not (isinstance(shard, str) and shard.endswith(".safetensors") and "/" not in shard and "\\" not in shard):
            raise CheckpointError(f"index {folder / key} names {str(shard)[:80]!r}, which is not a safetensors file beside it")
        if not os.path.lexists(folder / shard):
            raise CheckpointError(f"missing shard {shard}: {key} lists it but it is not in {folder}")
    return shards


# --- recovery ------------------------------------------------------------------------------------


def recover(path: str | Path, *, own: bool = False) -> list[str]:
    """Roll back in-place runs on the checkpoint at ``path`` (a file or folder) that did not finish.

    Returns one note per journal handled (an empty list when there was nothing to do). A journal
    whose run is still going (its lock is held) is left alone; one that fails a check is refused
    (CheckpointError) and left in place. For a shard, the journal of its index too, unless ``own``
    (what an in-place run on the shard alone asks for).
    """
    notes = []
    for key, journal in find_journals(Path(path), unfinished=True, own=own):
        folder, unfinished = journal.parent, journal.name.endswith(".tmp")
        if unfinished and not os.path.isfile(folder / key):
            continue
        files = checkpoint_files(folder, key)
        lock = [folder / f for f in dict.fromkeys([key, *files])]
        try:
            with locks.hold(lock, exclusive=True):
                if unfinished:  # never completed, so nothing was patched
                    journal.unlink(missing_ok=True)
                    notes.append(f"removed {journal.name}, left by an in-place run that died before patching anything")
                elif os.path.lexists(journal):
                    restored = apply(folder, key, journal, files)
                    notes.append(f"rolled back an interrupted in-place run: {', '.join(restored)} in {folder} are as they were before it")
        except locks.Busy:
            notes.append(f"an in-place run on {folder / key} is in progress (journal {journal.name}); not touched")
    return notes


def apply(folder: Path, key: str, journal: Path, files: list[str]) -> list[str]:
    """Check ``journal`` against the checkpoint's files as they are now, then write its old bytes back
    and remove it; returns the files it covers. The caller holds the checkpoint's lock."""
    jfd = jf.open_journal(journal)
    fds: dict[str, int] = {}
    try:
        if not files:
            raise CheckpointError(f"{folder / key} lists no weight files")
        for f in files:
            fds[f] = open_file(folder / f, write=True)
        headers = {f: read_header_fd(fds[f], folder / f) for f in files}
        limit = 65536 + sum(len(h.entries) + 1 for h in headers.values()) * (128 + max(map(len, files)))
        meta, n = jf.read_meta(jfd, journal, limit)
        idents, ranges = jf.check_meta(meta, journal, key, set(files))
        _check_identity(journal, folder, key, meta, idents, fds, headers, ranges)
        jf.check_ranges(journal, ranges, headers)
        jf.check_body(jfd, journal, n, ranges)
        states = [jf.state(journal, r, fds[r.file], jfd) for r in ranges]
        for r, now in zip(ranges, states, strict=True):
            if r.offset == 0 and now != "old":
                jf.check_old_header(journal, r, jfd, headers[r.file])
        for r, now in zip(ranges, states, strict=True):  # every check passed: only now is anything written
            if now != "old":
                jf.restore(r, fds[r.file], jfd, journal)
        for f in idents:
            os.fsync(fds[f])
    finally:
        for fd in [jfd, *fds.values()]:
            os.close(fd)
    os.unlink(journal)
    jf.fsync_dir(folder)
    return sorted(idents)


def _check_identity(journal: Path, folder: Path, key: str, meta: dict, idents: dict[str, dict], fds: dict[str, int],
                    headers: dict[str, Header], ranges: list[jf.Range]) -> None:
    """The files are those the journal was written for, with the headers they had (or the new ones it wrote)."""
    index = hashlib.sha256(_read_small(folder / key)).hexdigest() if key.endswith(INDEX_SUFFIX) else None
    if meta.get("index_sha256") != index:
        raise jf.refuse(journal, f"{key} is not the index it was written for")
    header_ranges = {r.file for r in ranges if r.offset == 0}
    for name, ident in idents.items():
        st = os.fstat(fds[name])
        if (st.st_size, st.st_dev, st.st_ino) != (ident["size"], ident["dev"], ident["ino"]):
            raise jf.refuse(journal, f"{name} is not the file it was written for (its size, device or inode differ: saved again since?)")
        if name not in header_ranges:
            now = hashlib.sha256(os.pread(fds[name], headers[name].data_start, 0)).hexdigest()
            if now != ident["header_sha256"]:
                raise jf.refuse(journal, f"the header of {name} is not the one it was written for")


# --- in place ------------------------------------------------------------------------------------


def check_in_place(source: Source) -> None:
    """Refuse ``--in-place`` where the bytes are shared, or where a second copy of the weights would be left stale."""
    if len(source.weights) > 1:
        others = ", ".join(w.describe() for w in source.weights[1:])
        raise OutputError(
            f"{source.folder} holds the weights twice ({source.primary.describe()} and {others}); {opt('in_place', True)} "
            f"would patch only the first and leave the other stale: remove the copy you do not use, or write a new folder with {opt('output')}"
        )
    weights = source.primary
    for f in weights.all_files:
        path = weights.folder / f
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise OutputError(
                f"{path} is a symbolic link (as in a Hugging Face cache snapshot): patching it in place would change the file "
                f"it points to, which other copies may share; write a copy with {opt('output')}", path=path
            )
        if st.st_nlink > 1:
            raise OutputError(
                f"{path} has {st.st_nlink} hard links: patching it in place would change every one of them; "
                f"write a copy with {opt('output')}", path=path
            )


@contextmanager
def hold(source: Source, *, exclusive: bool) -> Iterator[None]:
    """The checkpoint's lock for a run: exclusive (in place, refused at once when held) or shared (a copy,
    which waits a while for an in-place run to finish); then no journal may be there."""
    files = [w.folder / f for w in source.weights for f in w.all_files]
    try:
        with locks.hold(files, exclusive=exclusive, wait=0.0 if exclusive else locks.COPY_WAIT_S):
            refuse_journals(source.path)
            yield
    except locks.Busy as busy:
        if exclusive:
            raise OutputError(f"another surgeon run is patching {source.path} in place, or reading it; wait for it to finish") from None
        raise OutputError(
            f"an in-place run has been patching {busy.path} for over {locks.COPY_WAIT_S:.0f} s; run this again when it has finished"
        ) from None


def patch_in_place(source: Source, updates: UpdatesFn, record: dict) -> list[str]:
    """Patch the changed tensors of a safetensors checkpoint in place, journaled; returns notes.

    The caller holds the checkpoint's lock exclusively (:func:`hold`) and has run :func:`check_in_place`."""
    weights = cast(SafetensorsWeights, source.primary)  # --in-place is for safetensors only (api)
    changed = _changed_files(weights, updates)
    if not changed:
        return []
    fds: dict[str, int] = {}
    try:
        for f in changed:
            fds[f] = open_file(weights.folder / f, write=True)
            if read_header_fd(fds[f], weights.folder / f).entries != weights.headers[f].entries:
                raise CheckpointError(f"{weights.folder / f} changed since it was opened; run this again")
        headers = _patch(weights, changed, fds, updates, record)
    finally:
        for fd in fds.values():
            os.close(fd)
    skipped = [f for f in changed if headers[f] is None]
    if not skipped:
        return []
    return [
        f"surgeon's record was not added to the header of {', '.join(skipped)}: it does not fit without moving every "
        f"tensor, and {opt('in_place', True)} rewrites only the changed bytes (write a copy with {opt('output')} to get the record)"
    ]


def _patch(weights: SafetensorsWeights, changed: dict[str, list[str]], fds: dict[str, int], updates, record: dict) -> dict[str, bytes | None]:
    folder, key = weights.folder, weights.index or weights.files[0]
    headers: dict[str, bytes | None] = {}
    ranges: list[jf.Range] = []
    where: dict[tuple[str, str | None], int] = {}
    for file, names in changed.items():
        header = weights.headers[file]
        headers[file] = _header_in_place(header, record)
        if headers[file] is not None:
            where[file, None] = len(ranges)
            ranges.append(jf.Range(file, 0, header.data_start))
        for name in names:
            begin, end = header.entries[name]["data_offsets"]
            if end > begin:
                where[file, name] = len(ranges)
                ranges.append(jf.Range(file, header.data_start + begin, end - begin))
    journal = journal_path(folder, key)
    meta = _meta(weights, key, changed, fds) | {"ranges": [[r.file, r.offset, r.length] for r in ranges]}
    # The journal is written (and fsynced) on a background thread while torch loads and the first new
    # value is computed; nothing is patched before it is durable. Each value is then written as soon as
    # it is computed (its digest logged first), so one is in memory at a time.
    with ThreadPoolExecutor(1, thread_name_prefix="surgeon-journal") as pool:
        durable = pool.submit(jf.write, journal, meta, fds, ranges)
        log = _Log(durable, journal, ranges, where)
        try:
            _patch_files(weights, changed, headers, updates, log, fds)
        except BaseException as exc:
            log.close()
            _undo(weights, key, journal, durable, exc)
            raise
        log.close()
    os.unlink(journal)
    jf.fsync_dir(folder)
    return headers


def _meta(weights: SafetensorsWeights, key: str, changed: dict[str, list[str]], fds: dict[str, int]) -> dict:
    files = {}
    for f in changed:
        st = os.fstat(fds[f])
        head = os.pread(fds[f], weights.headers[f].data_start, 0)
        files[f] = {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "header_sha256": hashlib.sha256(head).hexdigest()}
    index = hashlib.sha256(_read_small(weights.folder / key)).hexdigest() if weights.index else None
    return {"version": 2, "checkpoint": key, "index_sha256": index, "files": files}


class _Log:
    """Appends each range's new-bytes record to the journal, durable before the range is written."""

    def __init__(self, durable: Future, path: Path, ranges: list[jf.Range], where: dict) -> None:
        self.durable, self.path, self.ranges, self.where = durable, path, ranges, where
        self.fd: int | None = None

    def before(self, file: str, name: str | None, data) -> None:
        self.durable.result()  # nothing is written before the journal is durable
        i = self.where.get((file, name))
        if i is None:
            return
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        jf.append(self.fd, jf.new_record(i, self.ranges[i], data))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _undo(weights: SafetensorsWeights, key: str, journal: Path, durable: Future, exc: BaseException) -> None:
    """A failure part-way (a refused head, a full disk, Ctrl-C) is rolled back at once from the journal.
    If the journal itself failed, nothing was patched. If the rollback fails too (a second Ctrl-C), say so."""
    if durable.exception() is not None:
        return
    try:
        apply(weights.folder, key, journal, weights.files)
    except BaseException as failed:
        interrupted = isinstance(exc, KeyboardInterrupt) or isinstance(failed, KeyboardInterrupt)
        error = HalfPatchedError(
            f"{'interrupted' if interrupted else 'failed'} while undoing an in-place run: {', '.join(weights.files)} in "
            f"{weights.folder} may be half-patched, and their old bytes are kept in {journal.name}; run `surgeon recover "
            f"{weights.folder / key}` to finish the rollback", path=journal
        )
        error.exit_code = 130 if interrupted else 1
        raise error from None


def _patch_files(weights: SafetensorsWeights, changed: dict[str, list[str]], headers: dict[str, bytes | None], updates,
                 log: _Log, fds: dict[str, int]) -> None:
    def logged(file, items):
        for name, tensor in items:
            log.before(file, name, _raw(tensor))
            yield name, tensor

    for file in changed:
        header = weights.headers[file]
        written = patch(header, weights.folder / file, header.data_start, logged(file, updates(file)))
        if set(written) != set(changed[file]):
            raise AssertionError(f"in-place patch of {file} is missing {sorted(set(changed[file]) - set(written))[:3]}")
        log.durable.result()
        new_header = headers[file]
        if new_header is not None:
            log.before(file, None, new_header)
            os.pwrite(fds[file], new_header, 0)
        os.fsync(fds[file])


def _raw(tensor):
    """The bytes a tensor is stored as (little-endian, as in safetensors), without a copy where it can."""
    import torch

    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


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
    import struct

    raw = encode_header(with_metadata(header.entries, add_record(header.metadata, record)))
    if len(raw) > header.length:
        return None
    return struct.pack("<Q", header.length) + raw + b" " * (header.length - len(raw))
