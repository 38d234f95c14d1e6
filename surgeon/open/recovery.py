"""Finding the journals of a checkpoint, and rolling one back once it has passed every check.

Read-only commands only look for journals by name (:func:`refuse_journals`). :func:`recover` (``surgeon
recover``, and an in-place run on the same checkpoint) takes the checkpoint's lock, opens its files
without following links, checks the journal against them (:mod:`surgeon.formats.journal_file`), and only then
writes the old bytes back. See :mod:`surgeon.write.journal` for the whole story.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, HalfPatchedError, OutputError
from ..files import locks
from ..files.bounded import INDEX_LIMIT, loads
from ..formats import journal_file as jf
from ..formats.journal_file import SUFFIX
from ..formats.safetensors import FILE_SUFFIX, INDEX_SUFFIX
from ..formats.safetensors_header import Header, read_header_fd

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
        raise OutputError(
            f"an in-place run is patching {target} right now (journal {journal.name}{more}); run this again when it has finished"
        )
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


def read_small(path: Path) -> bytes:
    fd = open_file(path, write=False)
    try:
        size = os.fstat(fd).st_size
        if size > INDEX_LIMIT:
            raise CheckpointError(f"index {path} is {size} bytes: too large for an index file", path=path)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def checkpoint_files(folder: Path, key: str) -> list[str]:
    """The weight files of the checkpoint ``key``: itself, or the shards its own index names (plain names)."""
    if not os.path.lexists(folder / key):
        raise CheckpointError(
            f"a journal in {folder} belongs to {key}, which is missing; restore {key} or delete the journal"
        )
    if not key.endswith(INDEX_SUFFIX):
        if not key.endswith(FILE_SUFFIX):
            raise CheckpointError(
                f"a journal in {folder} names {key}, which is not a safetensors checkpoint; surgeon never wrote it"
            )
        return [key]
    try:
        weight_map = loads(read_small(folder / key), where=f"index {folder / key}")["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"cannot read index {folder / key}: expected JSON with a 'weight_map'", path=folder / key
        ) from None
    for shard in shards:
        if not (isinstance(shard, str) and shard.endswith(FILE_SUFFIX) and "/" not in shard and "\\" not in shard):
            raise CheckpointError(
                f"index {folder / key} names {str(shard)[:80]!r}, which is not a safetensors file beside it"
            )
        if not os.path.lexists(folder / shard):
            raise CheckpointError(f"missing shard {shard}: {key} lists it but it is not in {folder}")
    return shards


# --- recovery ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovered:
    """What :func:`recover` did with one journal."""

    action: str  # "rolled_back", "removed_unfinished" (its run died before patching) or "in_progress" (left alone)
    checkpoint: Path  # the file or index the journal belongs to
    journal: Path
    files: tuple[str, ...] = ()  # the files given back (rolled_back)

    def note(self) -> str:
        """The line ``surgeon recover`` prints for it."""
        if self.action == "removed_unfinished":
            return f"removed {self.journal.name}, left by an in-place run that died before patching anything"
        if self.action == "rolled_back":
            return (
                f"rolled back an interrupted in-place run: {', '.join(self.files)} in {self.checkpoint.parent} "
                "are as they were before it"
            )
        return f"an in-place run on {self.checkpoint} is in progress (journal {self.journal.name}); not touched"

    def to_dict(self) -> dict:
        return {
            "action": self.action,
            "checkpoint": str(self.checkpoint),
            "journal": str(self.journal),
            "files": list(self.files),
        }


def recover(path: str | Path, *, own: bool = False) -> list[str]:
    """Roll back in-place runs on the checkpoint at ``path`` that did not finish.

    A journal whose run is still going (its lock is held) is left alone; for a shard, the journal of its
    index is handled too, unless ``own`` (what an in-place run on the shard alone asks for).

    Args:
        path: A checkpoint file, index or folder.
        own: Only the journal of ``path`` itself, not that of an index listing it.

    Returns:
        One note per journal handled; an empty list when there was nothing to do.

    Raises:
        CheckpointError: A journal fails a check (it is left in place).
        HalfPatchedError: Writing the old bytes back failed part-way.
    """
    return [done.note() for done in recover_journals(path, own=own)]


def recover_journals(path: str | Path, *, own: bool = False) -> list[Recovered]:
    """:func:`recover`, saying what was done with each journal."""
    done: list[Recovered] = []
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
                    done.append(Recovered("removed_unfinished", folder / key, journal))
                elif os.path.lexists(journal):
                    try:
                        restored = apply(folder, key, journal, files)
                    except HalfPatchedError as exc:  # say what earlier journals already gave back
                        exc.context = f"{'; '.join(d.note() for d in done)}; then " if done else None
                        raise
                    done.append(Recovered("rolled_back", folder / key, journal, tuple(restored)))
        except locks.Busy:
            done.append(Recovered("in_progress", folder / key, journal))
    return done


def apply(folder: Path, key: str, journal: Path, files: list[str]) -> list[str]:
    """Check ``journal`` against the checkpoint's files as they are now, then write its old bytes back
    and remove it; returns the files it covers. The caller holds the checkpoint's lock."""
    jfd = jf.open_journal(journal)
    fds: dict[str, int] = {}
    try:
        if not files:
            raise CheckpointError(f"{folder / key} lists no weight files")
        meta, n = jf.read_meta(jfd, journal, _meta_limit(folder, files))
        idents, ranges = jf.check_meta(meta, journal, key, set(files))
        for f in idents:  # only the files it names are opened for writing
            fds[f] = open_file(folder / f, write=True)
        headers = {f: read_header_fd(fds[f], folder / f) for f in idents}
        _check_identity(journal, folder, key, meta, idents, fds, headers, ranges)
        jf.check_ranges(journal, ranges, headers)
        jf.check_body(jfd, journal, n, ranges)
        states = [jf.state(journal, r, fds[r.file], jfd) for r in ranges]
        for r, now in zip(ranges, states, strict=True):
            if r.offset == 0 and now != "old":
                jf.check_old_header(journal, r, jfd, headers[r.file])
        changed = [r for r, now in zip(ranges, states, strict=True) if now != "old"]
        _restore(folder / key, journal, changed, fds, jfd)  # every check passed: only now is anything written
    finally:
        for fd in [jfd, *fds.values()]:
            os.close(fd)
    return sorted(idents)


def _restore(target: Path, journal: Path, changed: list[jf.Range], fds: dict[str, int], jfd: int) -> None:
    """Write back the old bytes of ``changed``, then remove the journal. Ctrl-C part-way says what is true:
    how many tensors are back, and that the journal is kept (a second rollback accepts a range that is
    part old, part new, so running it again finishes the job)."""
    try:
        for r in changed:
            jf.restore(r, fds[r.file], jfd, journal)
        for fd in fds.values():
            os.fsync(fd)
        os.unlink(journal)
        jf.fsync_dir(target.parent)
    except KeyboardInterrupt:
        if not os.path.lexists(journal):
            raise HalfPatchedError(
                f"interrupted after rolling back {target}: every tensor is as it was, and its journal is removed",
                path=target,
                interrupted=True,
            ) from None
        raise HalfPatchedError(
            f"interrupted while rolling back {target}: {_restored(changed, journal, fds, jfd)} of {len(changed)} "
            f"changed tensors are restored and the others may be half-restored; the old bytes are still in "
            f"{journal.name} (kept): run `surgeon recover {target}` again to finish",
            path=journal,
            interrupted=True,
        ) from None


def _restored(changed: list[jf.Range], journal: Path, fds: dict[str, int], jfd: int) -> str:
    """How many of ``changed`` hold their old bytes now, read back (a number, not a guess from a counter)."""
    try:
        return str(sum(jf.state(journal, r, fds[r.file], jfd) == "old" for r in changed))
    except BaseException:  # noqa: BLE001 - a second Ctrl-C, or a range refused now: say less, never more
        return "some"


def _meta_limit(folder: Path, files: list[str]) -> int:
    """The most bytes a journal's range list can need for this checkpoint: a few per tensor and file."""
    entries = 0
    for f in files:
        fd = open_file(folder / f, write=False)
        try:
            entries += len(read_header_fd(fd, folder / f).entries) + 1
        finally:
            os.close(fd)
    return 65536 + entries * (128 + max(map(len, files)))


def _check_identity(
    journal: Path,
    folder: Path,
    key: str,
    meta: dict,
    idents: dict[str, dict],
    fds: dict[str, int],
    headers: dict[str, Header],
    ranges: list[jf.Range],
) -> None:
    """The files are those the journal was written for, with the headers they had (or the new ones it wrote)."""
    index = hashlib.sha256(read_small(folder / key)).hexdigest() if key.endswith(INDEX_SUFFIX) else None
    if meta.get("index_sha256") != index:
        raise jf.refuse(journal, f"{key} is not the index it was written for")
    header_ranges = {r.file for r in ranges if r.offset == 0}
    for name, ident in idents.items():
        st = os.fstat(fds[name])
        if (st.st_size, st.st_dev, st.st_ino) != (ident["size"], ident["dev"], ident["ino"]):
            raise jf.refuse(
                journal,
                f"{name} is not the file it was written for (its size, device or inode differ: saved again since?)",
            )
        if name not in header_ranges:
            now = hashlib.sha256(os.pread(fds[name], headers[name].data_start, 0)).hexdigest()
            if now != ident["header_sha256"]:
                raise jf.refuse(journal, f"the header of {name} is not the one it was written for")
