"""In-place patching of safetensors checkpoints, made crash safe by an undo journal.

``surgeon reinit --in-place`` on safetensors rewrites only the byte ranges of the re-initialized
tensors (and the header, when surgeon's record fits in its existing length), instead of the whole
checkpoint. Before the first byte changes, the old bytes of every range are saved to a journal beside
the checkpoint (``.<name>.surgeon-journal``, format in :mod:`surgeon.formats.journal_file`) and made durable;
the digest of each range's new bytes is appended just before that range is written. After the patch
is fsynced, the journal is removed.

A run that dies in between leaves the journal. Only ``surgeon recover PATH`` (and the next ``--in-place``
run on the same checkpoint) rolls it back, and only after checking it belongs to the files as they are
now: same files (size, device, inode), same headers, every range exactly one tensor's bytes (or the
header) and holding its old or its new bytes. Every other command refuses a checkpoint with a journal
and names ``surgeon recover``: a half-patched checkpoint is never read, copied or pushed.

One lock per checkpoint (:mod:`surgeon.files.locks`) on the index and every shard: exclusive for in-place
runs and recoveries, shared for copies and ``inspect``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import CheckpointError, HalfPatchedError, OutputError, opt
from ..files import locks
from ..formats import journal_file as jf
from ..formats.journal_file import journal_path
from ..formats.safetensors import SafetensorsWeights, patch
from ..formats.safetensors_header import Header, add_record, encode_header, read_header_fd, with_metadata
from ..open.recovery import apply, open_file, read_small, refuse_journals

if TYPE_CHECKING:
    import torch
    from _typeshed import ReadableBuffer

    from ..formats.base import UpdatesFn
    from ..open.source import Source


# --- in place ------------------------------------------------------------------------------------


def refuse_second_copies(source: Source) -> None:
    """Refuse ``--in-place`` (any format) where a second copy of the weights would be left stale: a second weight
    set of the folder (diffusers' fp16 variant, a .bin beside the .safetensors) or another format's file beside."""
    others = ", ".join(w.describe() for w in source.weights[1:]) or _other_copies(source)
    if others:
        raise OutputError(
            f"{source.folder} holds the weights twice ({source.primary.describe()} and {others}); {opt('in_place', True)} "
            f"would patch only the first and leave the other stale: remove the copy you do not use, or write a new folder with {opt('output')}"
        )


def check_in_place(source: Source) -> None:
    """Refuse a byte-range patch where the bytes are shared (symbolic and hard links)."""
    weights = source.primary
    for f in weights.all_files:
        path = weights.folder / f
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise OutputError(
                f"{path} is a symbolic link (as in a Hugging Face cache snapshot): patching it in place would change the file "
                f"it points to, which other copies may share; write a copy with {opt('output')}",
                path=path,
            )
        if st.st_nlink > 1:
            raise OutputError(
                f"{path} has {st.st_nlink} hard links: patching it in place would change every one of them; "
                f"write a copy with {opt('output')}",
                path=path,
            )


def _other_copies(source: Source) -> str:
    """For a file or index given alone: the weights of another format beside it, which loaders may read instead."""
    from ..formats.registry import FORMATS

    folder = source.folder
    top = sorted(p.name for p in folder.iterdir() if p.is_file())
    return ", ".join(n for fmt in FORMATS if fmt.name != source.format and not fmt.alone for n in fmt.pick(top))


@contextmanager
def hold(source: Source, *, exclusive: bool) -> Iterator[None]:
    """The checkpoint's lock for a run: exclusive (in place, refused at once when held) or shared (a copy,
    which waits a while for an in-place run to finish); then no journal may be there."""
    files = [w.folder / f for w in source.weights for f in w.local_files]
    try:
        with locks.hold(files, exclusive=exclusive, wait=0.0 if exclusive else locks.COPY_WAIT_S):
            refuse_journals(source.path)
            yield
    except locks.Busy as busy:
        if exclusive:
            raise OutputError(
                f"another surgeon run is patching {source.path} in place, or reading it; wait for it to finish"
            ) from None
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


def _patch(
    weights: SafetensorsWeights, changed: dict[str, list[str]], fds: dict[str, int], updates: UpdatesFn, record: dict
) -> dict[str, bytes | None]:
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
        files[f] = {
            "size": st.st_size,
            "dev": st.st_dev,
            "ino": st.st_ino,
            "header_sha256": hashlib.sha256(head).hexdigest(),
        }
    index = hashlib.sha256(read_small(weights.folder / key)).hexdigest() if weights.index else None
    return {"version": 2, "checkpoint": key, "index_sha256": index, "files": files}


class _Log:
    """Appends each range's new-bytes record to the journal, durable before the range is written."""

    def __init__(self, durable: Future, path: Path, ranges: list[jf.Range], where: dict) -> None:
        self.durable, self.path, self.ranges, self.where = durable, path, ranges, where
        self.fd: int | None = None

    def before(self, file: str, name: str | None, data: ReadableBuffer) -> None:
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
        interrupted = any(isinstance(e, KeyboardInterrupt) or getattr(e, "interrupted", False) for e in (exc, failed))
        raise HalfPatchedError(
            f"{'interrupted' if interrupted else 'failed'} while undoing an in-place run: {', '.join(weights.files)} in "
            f"{weights.folder} may be half-patched, and their old bytes are kept in {journal.name}; run `surgeon recover "
            f"{weights.folder / key}` to finish the rollback",
            path=journal,
            interrupted=interrupted,
        ) from None


def _patch_files(
    weights: SafetensorsWeights,
    changed: dict[str, list[str]],
    headers: dict[str, bytes | None],
    updates: UpdatesFn,
    log: _Log,
    fds: dict[str, int],
) -> None:
    def logged(file: str, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
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


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes a tensor is stored as (little-endian, as in safetensors), without a copy where it can."""
    import torch

    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data


def _changed_files(weights: SafetensorsWeights, updates: UpdatesFn) -> dict[str, list[str]]:
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
