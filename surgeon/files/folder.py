"""Which files of a model folder surgeon may read, copy or upload: the folder's own, never one a link brings in.

A model folder is a stranger's (a ``git clone``, an unpacked archive), and a link in it can point anywhere
on the disk: ``README.md -> ~/.ssh/id_rsa`` would become the model card, a ``tokenizer.json`` link a file
of the output, and both would be pushed to the Hub. So every file surgeon finds in a folder goes through
:func:`classify`: a regular file is read; a link is read only when it leads to a regular file inside the
folder's own resolved tree, or, for a Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/REV``),
into that same repo's ``blobs/`` (the cache's own links). Any other link to a file is refused in one line,
naming the link and its target. Links to folders are never walked and FIFOs, sockets, devices and links
to nothing are never opened (opening a FIFO hangs): they are left out, and the caller says so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError

MISSING = "not there"
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


@dataclass
class FolderFiles:
    """What a walk of a folder found: the files surgeon may read, and what it left out (never opened)."""

    files: list[str] = field(default_factory=list)  # relative posix paths, sorted
    left_out: list[str] = field(default_factory=list)  # "NAME (why)", sorted

    def note(self) -> list[str]:
        """The report's note on what was left out, if anything was."""
        if not self.left_out:
            return []
        return [f"left out, never opened (surgeon reads only regular files from a folder): {', '.join(self.left_out)}"]


@dataclass(frozen=True)
class _Root:
    """A folder's resolved path, and the blob store its links may lead into (a Hub cache snapshot's)."""

    real: str
    blobs: str | None

    @classmethod
    def of(cls, folder: Path) -> _Root:
        real = os.path.realpath(folder)
        for p in (Path(real), *Path(real).parents):  # the snapshot itself, or a folder inside one
            if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
                return cls(real, str(p.parent.parent / "blobs"))
        return cls(real, None)

    def holds(self, target: str) -> bool:
        inside = target != self.real and os.path.commonpath([target, self.real]) == self.real
        return inside or (self.blobs is not None and os.path.dirname(target) == self.blobs)


def walk(
    folder: Path, *, prune: Callable[[PurePosixPath, bool], bool] | None = None, names_only: bool = False
) -> FolderFiles:
    """Every file under ``folder`` that surgeon may read, walking no link; raises a one-line CheckpointError
    for a link that leads out of the folder. ``names_only``: a look at what the folder holds, for deciding
    whether it holds weights at all: a link out of it is listed among the files, not refused, and nothing may
    be read from that listing. ``prune(rel, is_folder)``: entries neither walked nor checked (bookkeeping such
    as ``.git``, that surgeon never reads)."""
    root, found = _Root.of(folder), FolderFiles()
    for here, dirs, names in os.walk(folder, followlinks=False):
        base = Path(here)
        kept = []
        for d in dirs:
            rel = PurePosixPath((base / d).relative_to(folder).as_posix())
            if prune is not None and prune(rel, True):
                continue
            if (base / d).is_symlink():  # os.walk lists a link to a folder among the folders, never entered
                found.left_out.append(f"{rel}/ (a link to a folder, {os.path.realpath(base / d)})")
                continue
            kept.append(d)
        dirs[:] = kept
        for n in names:
            rel = PurePosixPath((base / n).relative_to(folder).as_posix())
            if prune is not None and prune(rel, False):
                continue
            try:
                why = classify(folder, str(rel), root)
            except CheckpointError:
                if not names_only:
                    raise
                why = None
            if why is None:
                found.files.append(str(rel))
            else:
                found.left_out.append(f"{rel} ({why})")
    found.files.sort()
    found.left_out.sort()
    return found


def classify(folder: Path, rel: str, root: _Root | None = None) -> str | None:
    """None if ``folder/rel`` may be read as part of ``folder``; else why it is left out (not a regular
    file: never opened). Raises CheckpointError for a link that leads out of the folder."""
    root = root or _Root.of(folder)
    path = folder / rel
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return MISSING
    if stat.S_ISREG(mode):
        return None
    if not stat.S_ISLNK(mode):
        return "a folder" if stat.S_ISDIR(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    target = os.path.realpath(path)
    if os.path.isdir(target):
        return f"a link to a folder, {target}"
    if not root.holds(target):
        where = "outside the folder and its Hugging Face cache repo" if root.blobs else "outside the folder"
        raise CheckpointError(
            f"{rel} in {folder} is a link to {target}, {where}: surgeon reads no file from outside a model "
            "folder; replace the link with the file itself, or remove it",
            path=path,
        )
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a link to nothing"
    return None if stat.S_ISREG(mode) else f"a link to {_KINDS.get(stat.S_IFMT(mode), 'something')}"


def file_in(folder: Path, rel: str) -> Path | None:
    """``folder/rel``, a file surgeon needs by name (a shard, config.json, README.md), if it may be read;
    None when nothing is there. Raises a one-line CheckpointError when it is a link out of the folder,
    lies below a link to a folder, or is not a regular file."""
    parts = PurePosixPath(rel).parts
    for i in range(1, len(parts)):
        if (folder.joinpath(*parts[:i])).is_symlink():
            raise CheckpointError(
                f"{rel} in {folder} lies in {'/'.join(parts[:i])}, a link to a folder: surgeon walks into no "
                "linked folder; replace the link with the folder itself",
                path=folder / rel,
            )
    why = classify(folder, rel)
    if why == MISSING:
        return None
    if why is not None:
        raise CheckpointError(
            f"{rel} in {folder} is {why}, not a regular file: surgeon opens only regular files; "
            "replace it with the file itself",
            path=folder / rel,
        )
    return folder / rel
