"""A DCP checkpoint's ``.metadata``, read without running code from it, and checked against its files.

torch's own reader opens ``.metadata`` with a bare ``pickle.load``: a stranger's folder could run anything.
Here it goes through an unpickler that admits only DCP's metadata classes and the few values they hold
(``torch.Size``, dtypes, layouts, a ``PosixPath``); any other global is refused in one line naming it.
What it builds is then type-checked field by field into frozen values (:class:`Layout`), and every byte
range is checked against the real files before anything is allocated or read: a chunk path is spelled one way
(``./x`` is ``x``), names a ``.distcp`` file inside the folder (never one surgeon writes into an output), every
range lies inside its file, no two ranges overlap, a tensor's chunks tile it exactly,
and a chunk's elements fit in the bytes stored for it (a claim of 10^12 elements is refused here).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CheckpointError
from ..files.bounded import read_bytes
from ..files.folder import file_in
from .suffixes import DCP_SUFFIX

METADATA = ".metadata"
SUFFIX = DCP_SUFFIX  # the registry's
METADATA_LIMIT = 1 << 30  # a 405B model's metadata over thousands of ranks is some hundreds of MiB

_DCP = "torch.distributed.checkpoint"
_CLASSES = {  # (module, name) as DCP pickles them -> where the class lives today
    (f"{_DCP}.metadata", n): (f"{_DCP}.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
# Megatron-Core's torch_dist keeps every rank's save plan in Metadata.all_local_plans (to reuse it on the next save):
# DCP's own planner dataclasses and an enum, built without running code; surgeon never reads them.
for _n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
    _CLASSES[(f"{_DCP}.planner", _n)] = (f"{_DCP}.planner", _n)
_CLASSES[(f"{_DCP}.filesystem", "_StorageInfo")] = (f"{_DCP}.filesystem", "_StorageInfo")
# Writers of the same format that pickle their own copy of _StorageInfo, the same (relative_path, offset, length)
# dataclass: read as torch's (nothing of theirs is imported). OLMo-core's RemoteFileSystemWriter.
_CLASSES[("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")] = (f"{_DCP}.filesystem", "_StorageInfo")
_CLASSES[("torch", "Size")] = ("torch", "Size")
_CLASSES[("torch.serialization", "_get_layout")] = ("torch.serialization", "_get_layout")  # a layout by its name
_CLASSES[("collections", "OrderedDict")] = ("collections", "OrderedDict")
for _m in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id (Python 3.13 moved the class)
    for _n in ("PosixPath", "PurePosixPath"):
        _CLASSES[(_m, _n)] = ("pathlib", _n)


def _global(module: str, name: str) -> Any:
    import importlib

    import torch

    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    where = _CLASSES.get((module, name))
    if where is None:
        raise _Refused(f"{module}.{name}")
    return getattr(importlib.import_module(where[0]), where[1])


class _Refused(Exception):
    pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({str(pid)[:40]})")


@dataclass(frozen=True)
class Span:
    """Bytes of one stored item: ``length`` bytes at ``offset`` in ``file`` (relative to the folder)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]  # where the chunk starts in the whole tensor
    sizes: tuple[int, ...]
    span: Span  # a torch.save archive of the chunk

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class TensorEntry:
    key: str  # DCP's flattened key ("model.model.layers.0.self_attn.q_proj.weight")
    dtype: str  # torch's name, "bfloat16"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]  # in storage order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor entry (train state, RNG state, an optimizer's hyper-parameters): a pickle surgeon never
    loads; its bytes are carried over as they are."""

    key: str
    span: Span


@dataclass(frozen=True)
class Layout:
    entries: dict[str, TensorEntry | BytesEntry]  # in the metadata's order
    paths: dict[str, tuple[str | int, ...]]  # key -> the path in the nested state dict DCP flattened
    files: tuple[str, ...]  # every data file the metadata names, sorted


def read_layout(folder: Path, sub: str = "") -> Layout:
    """The checked layout of the DCP checkpoint in ``folder`` (raises a one-line CheckpointError); in its
    subfolder ``sub`` (a training framework's layout), with every data file named relative to ``folder``."""
    if sub:
        return _under(read_layout(folder / sub), sub)
    path = folder / METADATA
    if file_in(folder, METADATA) is None:
        raise CheckpointError(f"{folder} has no {METADATA}: not a DCP checkpoint folder", path=folder)
    data = read_bytes(path, what="DCP metadata", limit=METADATA_LIMIT)
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"{path} asks for {exc}, which is not part of DCP's metadata: surgeon reads DCP metadata without "
            "running code from it; this checkpoint's .metadata is not one dcp.save writes",
            path=path,
        ) from None
    except Exception as exc:  # a damaged pickle: EOF, bad opcode, a class given wrong arguments
        raise CheckpointError(
            f"{path} is not a readable DCP metadata file ({type(exc).__name__}: {str(exc)[:120]}); re-save the checkpoint",
            path=path,
        ) from None
    layout = _checked(metadata, path)
    _check_files(folder, layout, path)
    return layout


def _under(layout: Layout, sub: str) -> Layout:
    """``layout`` with its data files named from the folder above, ``sub/__0_0.distcp``."""

    def moved(span: Span) -> Span:
        return replace(span, file=f"{sub}/{span.file}")

    entries: dict[str, TensorEntry | BytesEntry] = {
        k: replace(e, chunks=tuple(replace(c, span=moved(c.span)) for c in e.chunks))
        if isinstance(e, TensorEntry)
        else replace(e, span=moved(e.span))
        for k, e in layout.entries.items()
    }
    return Layout(entries, layout.paths, tuple(f"{sub}/{f}" for f in layout.files))


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; it is not metadata dcp.save writes, re-save the checkpoint", path=path)


def _ints(value: Any, path: Path, what: str) -> tuple[int, ...]:
    import torch

    if not isinstance(value, (torch.Size, tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _bad(path, f"{what} is {str(value)[:60]!r}, not a tuple of non-negative integers")
    return tuple(value)


def _checked(metadata: Any, path: Path) -> Layout:
    """DCP's unpickled objects, every field type-checked, as surgeon's frozen values."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata:
        raise _bad(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    sd, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(sd, dict) or not isinstance(storage, dict):
        raise _bad(path, "its state_dict_metadata or storage_data is not a dict")
    spans: dict[tuple[str, tuple[int, ...] | None], Span] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or not isinstance(index.fqn, str):
            raise _bad(path, f"its storage_data holds {type(index).__name__} -> {type(info).__name__}")
        offset = None if index.offset is None else _ints(index.offset, path, f"the offset of {index.fqn!r}")
        if transforms := getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: {index.fqn!r} is stored through {str(transforms)[:80]} (a DCP extension, "
                "e.g. compression); surgeon reads plain dcp.save checkpoints: re-save it without the extension",
                path=path,
            )
        rel = info.relative_path
        if not isinstance(rel, str) or type(info.offset) is not int or type(info.length) is not int:
            raise _bad(path, f"the storage of {index.fqn!r} is not a (file, offset, length)")
        if info.offset < 0 or info.length < 0:
            raise _bad(path, f"the storage of {index.fqn!r} has a negative offset or length")
        spans[(index.fqn, offset)] = Span(_relative(rel, path), info.offset, info.length)
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for key, item in sd.items():
        if not isinstance(key, str):
            raise _bad(path, f"it has a key {str(key)[:40]!r} that is not a string")
        if type(item) is BytesStorageMetadata:
            if (key, None) not in spans:
                raise _bad(path, f"it stores no bytes for {key!r}")
            entries[key] = BytesEntry(key, spans[(key, None)])
            continue
        if type(item) is not TensorStorageMetadata or type(item.properties) is not TensorProperties:
            raise _bad(path, f"{key!r} is a {type(item).__name__}, neither a tensor nor bytes")
        dtype = item.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise _bad(path, f"{key!r} has dtype {str(dtype)[:40]!r}")
        shape = _ints(item.size, path, f"the shape of {key!r}")
        if not isinstance(item.chunks, list):
            raise _bad(path, f"the chunks of {key!r} are not a list")
        chunks = []
        for c in item.chunks:
            offsets = _ints(getattr(c, "offsets", None), path, f"a chunk offset of {key!r}")
            sizes = _ints(getattr(c, "sizes", None), path, f"a chunk size of {key!r}")
            if (key, offsets) not in spans:
                raise _bad(path, f"it stores no bytes for the chunk of {key!r} at {list(offsets)}")
            chunks.append(Chunk(offsets, sizes, spans[(key, offsets)]))
        entry = TensorEntry(key, str(dtype).removeprefix("torch."), shape, tuple(chunks))
        _check_tiling(entry, dtype.itemsize, path)
        entries[key] = entry
    return Layout(entries, _paths(getattr(metadata, "planner_data", None), entries), _files(entries))


def _relative(rel: str, path: Path) -> str:
    """A data file's path from the metadata in its one spelling (``./x.distcp`` and ``x.distcp`` are one file), which
    must name a ``.distcp`` file inside the folder: never a file surgeon writes into an output (the model card and
    its record, ``.metadata``, a journal, a staging file), which would take the data file's place."""
    p = PurePosixPath(rel)
    parts = [part for part in rel.split("/") if part != "."]
    if not rel or "\\" in rel or "\0" in rel or p.is_absolute() or any(part in ("..", "") for part in parts):
        raise CheckpointError(
            f"{path} names the data file {rel[:80]!r}, which is not inside the checkpoint's folder: surgeon reads "
            "nothing outside it; this is not a checkpoint dcp.save writes",
            path=path,
        )
    canonical = "/".join(parts)
    if not canonical.endswith(SUFFIX) or canonical.split("/")[-1] == SUFFIX:
        raise CheckpointError(
            f"{path} names the data file {rel[:80]!r}: DCP's data files are named NAME{SUFFIX} (surgeon writes "
            f"its own files, such as the model card README.md and {METADATA}, beside them); this is not a "
            "checkpoint dcp.save writes",
            path=path,
        )
    return canonical


def _check_tiling(entry: TensorEntry, itemsize: int, path: Path) -> None:
    """The chunks lie inside the tensor, do not overlap, cover it, and each fits in its stored bytes."""
    ndim, covered = len(entry.shape), 0
    for i, c in enumerate(entry.chunks):
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            raise _bad(path, f"a chunk of {entry.key!r} has {len(c.offsets)} dimensions, the tensor {ndim}")
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, entry.shape)):
            raise _bad(
                path, f"a chunk of {entry.key!r} at {list(c.offsets)} reaches past its shape {list(entry.shape)}"
            )
        n = math.prod(c.sizes)
        if n * itemsize > c.span.length:
            raise _bad(
                path,
                f"the chunk of {entry.key!r} at {list(c.offsets)} claims {n} elements ({n * itemsize} bytes) in "
                f"{c.span.length} stored bytes",
            )
        for d in entry.chunks[:i]:
            if n and all(a < b + t and b < a + s for a, s, b, t in zip(c.offsets, c.sizes, d.offsets, d.sizes)):
                raise _bad(path, f"two chunks of {entry.key!r} overlap")
        covered += n
    if covered != entry.numel:
        raise _bad(path, f"the chunks of {entry.key!r} hold {covered} of its {entry.numel} elements")


def _paths(planner_data: Any, entries: dict) -> dict[str, tuple[str | int, ...]]:
    """Each key's path in the nested state dict (DCP keeps it as planner data), or the key itself."""
    out: dict[str, tuple[str | int, ...]] = {}
    for key in entries:
        p = planner_data.get(key) if isinstance(planner_data, dict) else None
        ok = isinstance(p, tuple) and bool(p) and all(type(x) in (str, int) for x in p)
        out[key] = p if ok and isinstance(p, tuple) else (key,)
    return out


def _files(entries: dict[str, TensorEntry | BytesEntry]) -> tuple[str, ...]:
    return tuple(sorted({span.file for _, span in _spans(entries)}))


def all_spans(layout: Layout) -> list[tuple[str, Span]]:
    """(key, span) of every stored item."""
    return _spans(layout.entries)


def _spans(entries: dict[str, TensorEntry | BytesEntry]) -> list[tuple[str, Span]]:
    out = []
    for e in entries.values():
        out += [(e.key, c.span) for c in e.chunks] if isinstance(e, TensorEntry) else [(e.key, e.span)]
    return out


def _check_files(folder: Path, layout: Layout, path: Path) -> None:
    """Every data file is a regular file in the folder, and every byte range lies inside it, alone."""
    sizes: dict[str, int] = {}
    seen: dict[tuple[int, int], str] = {}  # (device, inode) -> the first name of that file
    for rel in layout.files:
        found = file_in(folder, rel)  # a link out of the folder, a FIFO: refused here
        if found is None:
            raise CheckpointError(
                f"{path} names the data file {rel}, which is not in {folder}: the checkpoint is incomplete", path=path
            )
        st = os.stat(found)
        sizes[rel] = st.st_size
        # two names of one file (a hard link, a case-insensitive file system): their ranges would share bytes
        other = seen.setdefault((st.st_dev, st.st_ino), rel)
        if other != rel:
            raise _bad(path, f"its data files {other} and {rel} are one file")
        with open(found, "rb") as f:
            head = f.read(4)
        if head and head != b"PK\x03\x04":  # each item of torch_save serialization is a torch.save zip archive
            raise CheckpointError(
                f"{path}: its data file {rel} is not in DCP's default torch_save serialization (it starts with "
                f"{head!r}; FileSystemWriter's safetensors serialization?): re-save the checkpoint with the default",
                path=path,
            )
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for key, span in all_spans(layout):
        if span.offset + span.length > sizes[span.file]:
            raise CheckpointError(
                f"{path}: {key!r} is stored at bytes {span.offset}..{span.offset + span.length} of {span.file}, "
                f"which has {sizes[span.file]}: the file is truncated or the metadata is not its own",
                path=path,
            )
        by_file.setdefault(span.file, []).append((span.offset, span.offset + span.length, key))
    for rel, ranges in by_file.items():
        ranges.sort()
        for (_, end, a), (begin, _, b) in zip(ranges, ranges[1:]):
            if begin < end:
                raise _bad(path, f"{a!r} and {b!r} share bytes of {rel}")
