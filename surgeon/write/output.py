"""Where a reinit's output goes: one frozen :class:`Destination`, resolved before anything is written.

Its kind (an :class:`OutputKind`) is decided here, once, from the source and what the user asked
for; the destination then owns how its kind is staged and put in place (``staging.py``) and how big
the result is. Every check that can refuse an output runs in :func:`resolve_destination`, so a
refused output writes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import CheckpointError, OptionError, OutputError, opt
from ..files.bounded import refuse_special
from ..files.folder import file_in
from ..formats.fileio import clone_file
from ..formats.registry import OTHER_FORMAT_SUFFIXES, WEIGHT_SUFFIXES
from ..open.source import Source
from .staging import staged

if TYPE_CHECKING:
    from ..formats.base import RankedWeightSet, UpdatesFn, WeightSet
    from ..formats.write_plan import WritePlan

_WEIGHT_SUFFIXES = (
    WEIGHT_SUFFIXES + OTHER_FORMAT_SUFFIXES + (".json",)
)  # what a folder output's path must not look like


class OutputKind(str, enum.Enum):
    FILE = "file"  # one weight file (a file input; also in place, replaced atomically)
    FILES = "files"  # an .onnx with external data written as a file, its data files beside it
    FOLDER = "folder"  # a new model folder, with a model card
    MERGE = "merge"  # in place on a folder: each weight file replaced atomically, nothing else touched
    PATCH = "patch"  # in place on safetensors: only the changed byte ranges, journaled


@dataclass(frozen=True)
class Destination:
    """A resolved output: its path, kind, the files written beside it, and whether it is the input."""

    path: Path
    kind: OutputKind
    staged_name: str  # the main file's name in the staging folder (file kinds)
    companions: tuple[Path, ...] = ()  # FILES: the data files written beside ``path``
    in_place: bool = False
    changes_only: bool = False  # FOLDER staged for a push by changes: only changed shards and the card

    @property
    def gets_card(self) -> bool:
        return self.kind is OutputKind.FOLDER

    def write(
        self,
        source: Source,
        updates: Callable[[WeightSet, bool], UpdatesFn],
        record: dict,
        write_plans: Sequence[WritePlan],
        *,
        card: Callable[[Path], None],
    ) -> list[str]:
        """Write the output in this process: staged, the weights, the shared files and the card, put in place.

        ``updates(weights, record)`` gives each weight set's new tensors (the record goes into the first set
        only), ``write_plans`` what each set's format decided about writing them (``WeightSet.write_plan``, in
        the order of ``source.weights``); ``card(folder)`` writes the model card of a folder output. Returns
        notes for the report (temporary folders of killed runs left in place, a patch's notes). The ranks of a
        distributed run take the same steps (:meth:`staging`, :meth:`write_weights`, :meth:`write_shared`),
        each its own share of the data files (``surgeon.write.ranks``)."""
        if self.kind is OutputKind.PATCH:
            from .journal import patch_in_place

            return patch_in_place(source, updates(source.primary, True), record)
        notes: list[str] = []
        with self.staging(notes) as tmp:
            self.write_weights(tmp, source, updates, record, write_plans)
            self.write_shared(tmp, source, card=card)
        return notes

    def staging(self, notes: list[str]) -> AbstractContextManager[Path]:
        """The temporary folder the output is written into, put in place when the context ends without an error
        (``notes``: temporary folders of killed runs found beside it)."""
        return staged(self.path, self.kind, file_name=self.staged_name, notes=notes)

    def write_weights(
        self,
        tmp: Path,
        source: Source,
        updates: Callable[[WeightSet, bool], UpdatesFn],
        record: dict,
        write_plans: Sequence[WritePlan],
        *,
        share: list[str] | None = None,
    ) -> None:
        """Write the weight files into ``tmp`` (``share``: only these data files of the primary set, one rank's,
        their shared files left to :meth:`write_shared`)."""
        if self.kind is OutputKind.FILES:
            source.primary.save_as(tmp, self.path.name, updates(source.primary, True), record, write_plans[0])
            return
        for i, (weights, write_plan) in enumerate(zip(source.weights, write_plans, strict=True)):
            new = updates(weights, i == 0)
            files = share if share is not None else changed_files(weights, new) if self.changes_only else None
            if files is None:
                weights.save(tmp, new, record, write_plan)
            else:  # the rest is another rank's, or copied server-side (hub.copies)
                cast("RankedWeightSet", weights).save(tmp, new, record, write_plan, files)

    def write_shared(self, tmp: Path, source: Source, *, card: Callable[[Path], None], shares: bool = False) -> None:
        """Write what the weight files share (``shares``: the data files were written in shares, so the index
        or ``.metadata`` is written here), a folder input's other files and the model card."""
        if shares:
            cast("RankedWeightSet", source.primary).save_shared(tmp)
        if self.kind is OutputKind.FOLDER:
            if source.kind == "folder" and not self.changes_only:
                copy_extras(source, tmp)
            card(tmp)

    def size(self, source: Source, *, patched: int) -> int:
        """The bytes the output holds (``patched``: the bytes a patch rewrote)."""
        if self.kind is OutputKind.PATCH:
            return patched
        if self.kind is OutputKind.MERGE:
            return sum((self.path / f).stat().st_size for w in source.weights for f in w.all_files)
        if self.kind is OutputKind.FOLDER:
            return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return sum(p.stat().st_size for p in (self.path, *self.companions))


def changed_files(weights: WeightSet, updates: UpdatesFn) -> list[str]:
    """The files of ``weights`` that hold a tensor ``updates`` changes (safetensors shards)."""
    from ..formats.safetensors import SafetensorsWeights

    return cast(SafetensorsWeights, weights).changed_files(updates.names)


def resolve_destination(
    source: Source,
    output: str | Path | None,
    *,
    in_place: bool,
    overwrite: bool,
    push: bool = False,
    changes_only: bool = False,
) -> Destination:
    """The destination, after every check that can fail before anything is written.

    ``push``: the output is uploaded, so it must be a folder (even for an .onnx with external data);
    ``changes_only``: a staging folder for a push by changes (``hub.copies``)."""
    if in_place:
        return _in_place(source, output)
    if push and source.kind == "file":
        raise OptionError(
            f"{opt('push_to_hub')} uploads a model folder, and the output of {source.path.name} is a single file: "
            "give the model folder as MODEL"
        )
    dest = Path(output) if output is not None else default_output(source, folder=push)
    kind = _kind(source, dest)
    if kind is OutputKind.FILES and push:
        raise OutputError(
            f"{opt('push_to_hub')} uploads a model folder, and {opt('output', output)} names an .onnx file: "
            f"give a folder path (e.g. {opt('output', dest.with_suffix(''))})"
        )
    companions: tuple[Path, ...] = ()
    if kind is OutputKind.FILES:
        companions = tuple(dest.parent / n for n in source.primary.files_as(dest.name)[1:])
        _check_companions(source, dest, companions, overwrite=overwrite)
    if kind is OutputKind.FILE and dest.is_dir():
        dest = dest / source.path.name  # like cp: a folder given for a file output receives the file
    for path in (dest, *companions):  # replacing a FIFO or a device is not writing a checkpoint
        refuse_special(path, what=opt("output"), error=OutputError)
    if kind is OutputKind.FOLDER:
        _check_folder(source, dest, output)
    _check_not_input(source, dest, kind)
    if dest.exists() and not overwrite:
        raise OutputError(
            f"{dest} already exists; pass {opt('overwrite', True)} to replace it, or choose another path with {opt('output')}",
            path=dest,
        )
    if kind is OutputKind.FILES:
        return Destination(dest, kind, dest.name, companions)
    return Destination(dest, kind, source.path.name, changes_only=changes_only and kind is OutputKind.FOLDER)


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


def _kind(source: Source, dest: Path) -> OutputKind:
    """A file input gives a file; an .onnx with external data gives files when ``dest`` names an .onnx
    (a folder only when the user names one: a path without the .onnx suffix); anything else a folder."""
    if source.kind == "file":
        return OutputKind.FILE
    # a file named like the model (out.onnx): its data files go beside it
    if _onnx_with_data(source) and dest.suffix.lower() == source.path.suffix.lower() and not dest.is_dir():
        return OutputKind.FILES
    return OutputKind.FOLDER


def _in_place(source: Source, output: str | Path | None) -> Destination:
    if output is not None:
        raise OutputError(f"use either {opt('output')} or {opt('in_place', True)}, not both")
    if source.hub_id is not None:
        raise OutputError(
            f"{opt('in_place', True)} cannot write into the Hugging Face cache; use {opt('output')} to choose an output folder"
        )
    from .journal import check_in_place, refuse_second_copies

    refuse_second_copies(source)  # e.g. diffusers' fp16 variant beside the full weights: both would have to change
    if source.primary.patches_in_place:
        check_in_place(source)  # shared bytes (Hub cache links, hard links) would change elsewhere too
        return Destination(source.path if source.kind == "file" else source.folder, OutputKind.PATCH, "", in_place=True)
    if source.kind == "file":
        return Destination(source.path, OutputKind.FILE, source.path.name, in_place=True)
    return Destination(source.folder, OutputKind.MERGE, source.path.name, in_place=True)


def _check_folder(source: Source, dest: Path, output: str | Path | None) -> None:
    if not dest.is_dir() and dest.suffix.lower() in _WEIGHT_SUFFIXES:
        raise OutputError(
            f"{opt('output', output)} names a {dest.suffix} file, but the output of a {source.kind} input is a folder: "
            f"give a folder path (e.g. {opt('output', dest.with_suffix(''))}), or give the weight file itself as MODEL"
        )
    if dest.is_file():
        raise OutputError(
            f"{dest} is a file, but the output of a {source.kind} input is a folder; choose a folder path with {opt('output')}",
            path=dest,
        )


def _check_not_input(source: Source, dest: Path, kind: OutputKind) -> None:
    folder = kind is OutputKind.FOLDER
    inputs = {source.path.resolve(), source.folder.resolve()} if folder else {source.path.resolve()}
    if dest.resolve() in inputs:
        raise OutputError(
            f"{dest} is the input; surgeon writes a new copy unless you pass {opt('in_place', True)}", path=dest
        )
    if folder and source.folder.resolve() in dest.resolve().parents:
        raise OutputError(f"{dest} is inside the input folder {source.folder}; choose an output outside it")
    if dest.resolve() in source.path.resolve().parents:
        raise OutputError(f"{dest} holds the input {source.path}; choose an output that does not contain it")


def _check_companions(source: Source, dest: Path, companions: tuple[Path, ...], *, overwrite: bool) -> None:
    inputs = {(source.folder / f).resolve() for f in source.primary.all_files}
    for path in companions:
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


def copy_extras(source: Source, dest: Path) -> None:
    """Carry every non-weight file of a folder input over unchanged (tokenizer, configs, ...)."""
    for rel in source.extra_files:
        path = file_in(source.folder, rel)  # checked when the folder was opened; again, as it is copied now
        if path is None:
            raise CheckpointError(f"{rel} of {source.folder} is gone since the folder was opened; run this again")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        clone_file(path, target)  # shared with the source on a copy-on-write file system
