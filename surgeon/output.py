"""Where the output goes, and putting it there atomically.

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

from .errors import OutputError, opt
from .formats.registry import OTHER_FORMAT_SUFFIXES, WEIGHT_SUFFIXES
from .source import Source

_WEIGHT_SUFFIXES = (
    WEIGHT_SUFFIXES + OTHER_FORMAT_SUFFIXES + (".json",)
)  # what a folder output's path must not look like


def default_output(source: Source, *, folder: bool = False) -> Path:
    """Beside the input: ``model.reinit.safetensors`` for a file (and an .onnx with external data,
    unless ``folder``), ``<folder>-reinit`` for a folder."""
    if source.kind == "file" or (_onnx_with_data(source) and not folder):
        p = source.path
        return p.with_name(f"{p.stem}.reinit{p.suffix}")
    if source.hub_id is not None:
        return Path.cwd() / f"{source.hub_id.rsplit('/', 1)[-1]}-reinit"
    parent = source.path if source.kind == "folder" else source.path.parent
    return parent.with_name(f"{parent.name}-reinit")


def _onnx_with_data(source: Source) -> bool:
    return source.kind == "index" and source.primary.graph  # a graph with external data files named after it


def output_kind(source: Source, dest: Path | None = None) -> str:
    """ "file", "folder", or "files": an .onnx with external data written as the file ``dest`` with its
    data files beside it (a folder only when the user names one: a path without the .onnx suffix)."""
    if source.kind == "file":
        return "file"
    # a file named like the model (out.onnx): its data files go beside it
    if _onnx_with_data(source) and dest is not None and dest.suffix.lower() == source.path.suffix and not dest.is_dir():
        return "files"
    return "folder"


def companion_files(source: Source, dest: Path) -> list[Path]:
    """The files written beside ``dest`` when the output kind is "files" (an .onnx's renamed data files)."""
    from .formats.onnx_wire import renamed_data_files

    primary = source.primary
    return [dest.parent / n for n in renamed_data_files(primary.files[1:], source.path.name, dest.name).values()]


def resolve_output(
    source: Source, output: str | Path | None, *, in_place: bool, overwrite: bool, folder: bool = False
) -> Path:
    """The destination path, after every check that can fail before anything is written.

    ``folder``: the output must be a folder (a push), even for an .onnx with external data."""
    if in_place:
        if output is not None:
            raise OutputError(f"use either {opt('output')} or {opt('in_place', True)}, not both")
        if source.hub_id is not None:
            raise OutputError(
                f"{opt('in_place', True)} cannot write into the Hugging Face cache; use {opt('output')} to choose an output folder"
            )
        from .journal import refuse_second_copies

        refuse_second_copies(source)  # e.g. diffusers' fp16 variant beside the full weights: both would have to change
        return source.path if source.kind == "file" else source.folder
    dest = Path(output) if output is not None else default_output(source, folder=folder)
    kind = output_kind(source, dest)
    if kind == "files" and folder:
        raise OutputError(
            f"{opt('push_to_hub')} uploads a model folder, and {opt('output', output)} names an .onnx file: "
            f"give a folder path (e.g. {opt('output', dest.with_suffix(''))})"
        )
    if kind == "files":
        _check_companions(source, dest, overwrite=overwrite)
    if kind == "file" and dest.is_dir():
        dest = dest / source.path.name  # like cp: a folder given for a file output receives the file
    if kind == "folder" and not dest.is_dir() and dest.suffix.lower() in _WEIGHT_SUFFIXES:
        raise OutputError(
            f"{opt('output', output)} names a {dest.suffix} file, but the output of a {source.kind} input is a folder: "
            f"give a folder path (e.g. {opt('output', dest.with_suffix(''))}), or give the weight file itself as MODEL"
        )
    if kind == "folder" and dest.is_file():
        raise OutputError(
            f"{dest} is a file, but the output of a {source.kind} input is a folder; choose a folder path with {opt('output')}",
            path=dest,
        )
    inputs = {source.path.resolve(), source.folder.resolve()} if kind == "folder" else {source.path.resolve()}
    if dest.resolve() in inputs:
        raise OutputError(
            f"{dest} is the input; surgeon writes a new copy unless you pass {opt('in_place', True)}", path=dest
        )
    if kind == "folder" and source.folder.resolve() in dest.resolve().parents:
        raise OutputError(f"{dest} is inside the input folder {source.folder}; choose an output outside it")
    if dest.resolve() in source.path.resolve().parents:
        raise OutputError(f"{dest} holds the input {source.path}; choose an output that does not contain it")
    if dest.exists() and not overwrite:
        raise OutputError(
            f"{dest} already exists; pass {opt('overwrite', True)} to replace it, or choose another path with {opt('output')}",
            path=dest,
        )
    return dest


def _check_companions(source: Source, dest: Path, *, overwrite: bool) -> None:
    inputs = {(source.folder / f).resolve() for f in source.primary.all_files}
    for path in companion_files(source, dest):
        if path.resolve() in inputs:
            raise OutputError(
                f"{dest} would write its data file {path.name} over the input's; choose another name with {opt('output')}",
                path=path,
            )
        if path.exists() and not overwrite:
            raise OutputError(
                f"{path} already exists; pass {opt('overwrite', True)} to replace it, or choose another path with {opt('output')}",
                path=path,
            )
        if path.is_dir():
            raise OutputError(
                f"{path} is a folder, and the data file of {dest.name} goes there; choose another path with {opt('output')}",
                path=path,
            )


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


def copy_extras(source: Source, dest: Path) -> None:
    """Carry every non-weight file of a folder input over unchanged (tokenizer, configs, ...)."""
    for rel in source.extra_files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.folder / rel, target)


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
