"""Putting an output in place atomically, and cleaning up after killed runs.

Everything is written into a temporary folder beside the destination and renamed into place at
the end, so a failed or interrupted run leaves no partial output and never touches the input.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(dest: Path, kind: str, file_name: str | None = None, notes: list[str] | None = None) -> Iterator[Path]:
    """Yield a temporary folder to write into; on success move its content to ``dest``.

    ``kind`` "file": the folder must end up holding ``file_name``, which becomes ``dest``.
    ``kind`` "files": each file in the folder goes beside ``dest`` (its name is kept), ``file_name``
    last, becoming ``dest``: an .onnx whose data files are there before it is.
    ``kind`` "folder": the folder itself becomes ``dest`` (replacing an existing one).
    ``kind`` "merge": each file in the folder replaces its namesake in the existing folder ``dest``
    (in-place runs on a folder: every file is replaced atomically, nothing else is touched).

    The temporary folder's name records the process id and host of the run that made it
    (``.model.safetensors.pid123@host.x8k2.surgeon-tmp``). A run killed with SIGKILL cannot remove
    it; the next run writing to the same destination removes those whose process is gone, and adds a
    line to ``notes`` for any it cannot judge (another host, an older surgeon, a run still going).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    where = dest if kind == "merge" else dest.parent
    found = clean_stale(where, dest.name)
    if notes is not None:
        notes.extend(found)
    tmp = Path(tempfile.mkdtemp(prefix=_owner_prefix(dest.name), suffix=STAGING_SUFFIX, dir=where))
    try:
        yield tmp
        if kind == "merge":
            for p in sorted(tmp.rglob("*")):
                if p.is_file():
                    os.replace(p, dest / p.relative_to(tmp))
            shutil.rmtree(tmp)
        elif kind == "file":
            os.replace(tmp / (file_name or dest.name), dest)
            shutil.rmtree(tmp)
        elif kind == "files":
            main = tmp / (file_name or dest.name)
            for p in sorted(tmp.iterdir()):
                if p != main:
                    os.replace(p, dest.parent / p.name)
            os.replace(main, dest)
            shutil.rmtree(tmp)
        else:
            os.chmod(tmp, 0o777 & ~_umask())
            if dest.exists():
                old = Path(tempfile.mkdtemp(prefix=_owner_prefix(dest.name), suffix=OLD_SUFFIX, dir=dest.parent))
                os.rename(dest, old / "x")
                os.rename(tmp, dest)
                shutil.rmtree(old)
            else:
                os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


STAGING_SUFFIX = ".surgeon-tmp"
OLD_SUFFIX = ".surgeon-old"
_OWNED = re.compile(r"pid(\d+)@([A-Za-z0-9-]*)\.[A-Za-z0-9_]+\.surgeon-(tmp|old)")
_LEGACY = re.compile(r"[A-Za-z0-9_]{8}\.surgeon-(tmp|old)")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]


def _owner_prefix(name: str) -> str:
    return f".{name}.pid{os.getpid()}@{_host()}."


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OverflowError:
        return False
    try:  # a killed process its parent has not reaped yet is a zombie: gone for our purposes
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def stale_staging(where: Path, name: str) -> list[tuple[Path, str | None]]:
    """surgeon's temporary folders for destination ``name`` in ``where``: (path, why it is not removed,
    or None where its process is gone and it can be)."""
    out: list[tuple[Path, str | None]] = []
    prefix = f".{name}."
    try:
        entries = list(Path(where).iterdir())
    except OSError:
        return out
    for p in entries:
        if not p.name.startswith(prefix) or not p.is_dir() or p.is_symlink():
            continue
        rest = p.name[len(prefix) :]
        owned = _OWNED.fullmatch(rest)
        if owned:
            pid, host = int(owned.group(1)), owned.group(2)
            if host != _host():
                out.append((p, f"it was made by process {pid} on host {host}"))
            elif _alive(pid):
                out.append((p, f"process {pid} that made it is still running"))
            else:
                out.append((p, None))
        elif _LEGACY.fullmatch(rest):
            out.append((p, "an older surgeon made it and recorded no process"))
    return out


def clean_stale(where: Path, name: str) -> list[str]:
    """Remove the temporary folders of killed runs for destination ``name``; a note for each one left."""
    notes = []
    for path, why in stale_staging(where, name):
        if why is None:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                continue
            why = "it could not be removed"
        notes.append(
            f"left {path} in place ({why}): a temporary folder of an interrupted surgeon run; remove it once no run is writing there"
        )
    return notes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
