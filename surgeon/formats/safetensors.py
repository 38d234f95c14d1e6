"""safetensors, single file or sharded, read and patched at the byte level.

A file is ``<u64 little-endian N><N bytes of JSON header><data>``; data offsets in the header are
relative to the start of the data section. surgeon keeps every tensor's dtype and shape, so data
offsets never move: the output is the input's data section with the updated byte ranges
overwritten, behind a header that differs only in ``__metadata__``. Untouched tensors are copied
as bytes, never decoded.

The data section does not move either: the new header is padded with spaces to the source's length, or,
where it does not fit, grown by whole file system blocks (``output_length``). Every untouched byte then sits
at the same offset as in the source modulo a block, and the kernel copies it by sharing the source's blocks
on a copy-on-write file system; a shard with no change is cloned whole (``fileio.clone_file``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import CheckpointError, VerificationError
from ..files.bounded import loads
from .base import RankedWeightSet, TensorInfo, UpdatesFn, WeightSet, tensor_bytes
from .fileio import BLOCK, BackgroundCopies, clone_file, copy_range, count
from .safetensors_header import (
    DTYPES,
    METADATA_KEY,
    Header,
    add_record,
    encode_header,  # noqa: F401  (surgeon's safetensors writer, for the tests that tamper with a header)
    header_json,
    history_in,
    output_length,
    padded,
    read_header,
    with_metadata,
)
from .suffixes import SAFETENSORS_INDEX, SAFETENSORS_SUFFIX

if TYPE_CHECKING:
    import threading

    import torch

    from .byte_source import ByteSource
    from .write_plan import WritePlan

FILE_SUFFIX, INDEX_SUFFIX = SAFETENSORS_SUFFIX, SAFETENSORS_INDEX  # the registry's
_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items() if dtype is not None}


def tensor_info(header: Header, name: str, file: str) -> TensorInfo:
    entry = header.entries[name]
    dtype, _ = DTYPES.get(entry["dtype"], (None, None))
    begin, end = entry["data_offsets"]
    return TensorInfo(name, tuple(entry["shape"]), entry["dtype"], dtype, file, end - begin)


def torch_dtype(header: Header, name: str) -> torch.dtype:
    """The torch dtype of tensor ``name`` (refused where this torch has none)."""
    import torch

    entry = header.entries[name]
    element, _ = DTYPES.get(entry["dtype"], (None, None))
    dtype = getattr(torch, element, None) if element else None
    if dtype is None:
        raise CheckpointError(
            f"{header.path}: tensor {name!r} has dtype {entry['dtype']}, which this torch cannot decode",
            path=header.path,
            tensor=name,
        )
    return dtype


def read_tensor(header: Header, name: str) -> torch.Tensor:
    import torch

    entry = header.entries[name]
    dtype = torch_dtype(header, name)
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(end - begin)
    with open(header.path, "rb") as f:
        f.seek(header.data_start + begin)
        if f.readinto(buf) != len(buf):
            raise CheckpointError(
                f"{header.path} ended while reading tensor {name!r}: the file is truncated",
                path=header.path,
                tensor=name,
            )
    count(read=len(buf))
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def write_patched(header: Header, dest: Path, updates: dict[str, torch.Tensor], record: dict | None) -> None:
    """Write ``header``'s file to ``dest`` with ``updates`` patched in and ``record`` added."""
    data_start = start_file(header, dest, record)
    copy_gaps(header, dest, data_start, set(updates))
    patch(header, dest, data_start, updates.items())


def start_file(header: Header, dest: Path, record: dict | None, history: list | None = None) -> int:
    """Create ``dest`` at its final size with ``header`` (plus ``record``, appended to ``history``) written;
    returns where its data starts. Without a record the header is the original's bytes, so a shard with
    no change is byte for byte its source (and can be copied server-side on the Hub). With one, the header is
    padded to the source's length, or grown by whole blocks (:func:`output_header`).

    The data section is left as a hole, for :func:`copy_gaps` and :func:`patch` to fill in any order.
    """
    if record is None:
        with open(header.path, "rb") as src:
            raw_header = os.pread(src.fileno(), header.length, 8)
        if len(raw_header) != header.length:
            raise CheckpointError(f"{header.path} changed while surgeon read it; run this again", path=header.path)
    else:
        raw_header = output_header(header, with_metadata(header.entries, add_record(header.metadata, record, history)))
    data_start = 8 + len(raw_header)
    with open(dest, "wb") as out:
        out.write(struct.pack("<Q", len(raw_header)))
        out.write(raw_header)
        out.truncate(data_start + header.file_size - header.data_start)
    count(written=data_start)
    return data_start


def output_header(source: Header, entries: dict) -> bytes:
    """The header ``entries`` of an output of ``source``: the data starts where the source's does (the JSON
    padded with spaces), or, where the JSON does not fit, whole blocks later; so every data byte keeps its
    offset in its block and a copy-on-write file system shares every block no changed byte is in."""
    text = header_json(entries)
    return padded(text, output_length(source, len(text), BLOCK))


def clone_shard(header: Header, source: Path, dest: Path, cancel: threading.Event | None = None) -> None:
    """``dest`` becomes the file of ``header`` (at ``source``), cloned whole, never read."""
    clone_file(source, dest, cancel)
    if dest.stat().st_size != header.file_size:
        raise CheckpointError(f"{header.path} changed while surgeon read it; run this again", path=header.path)


def spans(header: Header, names: Iterable[str]) -> list[tuple[int, int]]:
    """The data-section byte ranges of ``names`` in ``header``'s file, in order."""
    return sorted(tuple(header.entries[n]["data_offsets"]) for n in names)


def copy_gaps(
    header: Header, dest: Path, data_start: int, skip: set[str], cancel: threading.Event | None = None
) -> None:
    """Copy the data section of ``header``'s file into ``dest``, leaving out the tensors in ``skip``."""
    size, pos = header.file_size - header.data_start, 0
    with open(header.path, "rb") as src, open(dest, "r+b") as out:
        for begin, end in spans(header, skip) + [(size, size)]:
            if begin > pos:
                copy_range(src, out, header.data_start + pos, data_start + pos, begin - pos, cancel=cancel)
            pos = max(pos, end)


def patch(header: Header, path: Path, data_start: int, updates: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Write each ``(name, tensor)`` of ``updates`` (an iterable, consumed one at a time) over its bytes
    in ``path``, whose data section starts at ``data_start``; returns the names written."""
    written = []
    with open(path, "r+b") as out:
        for name, tensor in updates:
            entry = header.entries[name]
            if (
                tuple(tensor.shape) != tuple(entry["shape"])
                or _NAMES.get(str(tensor.dtype).removeprefix("torch.")) != entry["dtype"]
            ):
                raise AssertionError(f"update of {name} changes its shape or dtype")
            data = tensor_bytes(tensor)
            os.pwrite(out.fileno(), data, data_start + entry["data_offsets"][0])
            count(written=len(data))
            written.append(name)
    return written


class SafetensorsWeights(RankedWeightSet):
    format = "safetensors"
    patches_in_place = True
    rewrites_whole_tensors = True
    graph = False
    record_slot = True
    shard_suffix = FILE_SUFFIX

    def __init__(
        self,
        folder: Path,
        files: list[str],
        index: str | None = None,
        headers: dict[str, Header] | None = None,
        source: ByteSource | None = None,
    ) -> None:
        """``headers``: the shards' headers, read already, and ``source``: where the shards' bytes are (a Hub
        model's, read by Range: surgeon.hub.remote); default: the files in ``folder``, headers read from them."""
        super().__init__(folder, files, index)
        if source is not None:
            self.bytes = source
        self.headers: dict[str, Header] = {}
        found: dict[str, str] = {}
        for file in files:
            path = folder / file
            if headers is None and not path.is_file():
                raise CheckpointError(
                    f"missing shard {file}: {index or 'the checkpoint'} lists it but it is not in {folder}"
                )
            header = self.headers[file] = read_header(path) if headers is None else headers[file]
            for name in header.tensor_entries():
                if name in found:
                    raise CheckpointError(f"tensor {name!r} is in both {found[name]} and {file}")
                found[name] = file
                self._infos[name] = tensor_info(header, name, file)
        self._check_index(found)

    def read(self, name: str) -> torch.Tensor:
        info = self._infos[name]
        if self.bytes.on_disk(info.file):
            return read_tensor(self.headers[info.file], name)
        import torch

        header = self.headers[info.file]
        dtype, shape = torch_dtype(header, name), tuple(header.entries[name]["shape"])
        data = self.raw(name)
        return (
            torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
        )

    def raw(self, name: str) -> bytes:
        info = self.tensors[name]
        header = self.headers[info.file]
        begin, end = header.entries[name]["data_offsets"]
        if end == begin:
            return b""
        if not self.bytes.on_disk(info.file):
            return self.bytes.read(info.file, header.data_start + begin, end - begin)
        with open(header.path, "rb") as f:
            f.seek(header.data_start + begin)
            data = f.read(end - begin)
        count(read=len(data))
        return data

    def nbytes(self) -> int:
        """The bytes of the set's files, from their headers (a remote shard is not on disk)."""
        return sum(h.file_size for h in self.headers.values()) + (
            (self.folder / self.index).stat().st_size if self.index else 0
        )

    def local_path(self, file: str) -> Path:
        """A shard on disk, fetched first where it is remote; a fetched shard whose header is not the one
        planned from is refused (the plan's offsets would not be its bytes)."""
        path = self.bytes.local(file)
        planned = self.headers.get(file)
        if planned is None or planned.path == path:
            return path
        local = read_header(path)
        if local.entries != planned.entries or local.file_size != planned.file_size:
            raise CheckpointError(
                f"{file} fetched from {self.bytes.describe(file)} is not the file whose header was read; "
                "remove it from the HF cache and run this again"
            )
        self.headers[file] = local  # read from the disk from here on
        return path

    def record_texts(self) -> list[tuple[str, list[str]]]:
        # an in-place run adds its record only to the shards whose header has room for it
        out = []
        for file in self.files:
            text = self.metadata(file).get(METADATA_KEY)
            out.append((file, [] if text is None else [text]))
        return out

    def changed_files(self, names: Iterable[str]) -> list[str]:
        """The shards holding any of the tensors ``names`` (the first shard where none does: the record has to
        go somewhere)."""
        wanted = set(names)
        return [f for f in self.files if wanted & self.headers[f].entries.keys()] or self.files[:1]

    def history(self) -> list:
        """surgeon's records in these files, the longest one (an earlier run wrote it only where it changed)."""
        return max((history_in(self.metadata(f)) for f in self.files), key=len, default=[])

    def metadata(self, file: str | None = None) -> dict[str, str]:
        return self.headers[file or self.files[0]].metadata

    def check_non_tensor(self, out: WeightSet, changed: set[str], history: list, output: object) -> None:
        """Each file's metadata is the original's but for surgeon's record, and a file's records are the
        ``history`` verified (or, where an in-place run could not fit its record in, the original's)."""
        out = cast(SafetensorsWeights, out)  # verify compares sets of the same format only
        if len(self.files) != len(out.files):
            raise VerificationError(f"{output} has {len(out.files)} safetensors files, the original {len(self.files)}")
        for file, out_file in zip(self.files, out.files):  # a single-file output may have another name than its input
            mine, theirs = self.metadata(file), out.metadata(out_file)
            if {k: v for k, v in theirs.items() if k != METADATA_KEY} != {
                k: v for k, v in mine.items() if k != METADATA_KEY
            }:
                raise VerificationError(
                    f"{output}: the metadata of {out_file} differs from the original's beyond surgeon's record"
                )
            text = theirs.get(METADATA_KEY)
            if text != mine.get(METADATA_KEY) and (
                text is None or _history(loads(text, where=f"{output}: the record of {out_file}")) != history
            ):
                raise VerificationError(f"{output}: {out_file} holds other surgeon records than the ones verified")

    def save(
        self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan, files: list[str] | None = None
    ) -> None:
        """``files``: only these shards, and not the index (one rank's share; see save_shared)."""
        # A shard with no change is cloned whole, never read. Every other one is created at its final size,
        # and all bytes but the changing tensors' are copied on a background thread (kernel-side, so it
        # overlaps torch's import and the math; shared, not copied, on a copy-on-write file system).
        # Meanwhile each new tensor is written into its own, disjoint, range as soon as it is computed, so
        # one tensor's new value is in memory at a time, whatever the size of the shard.
        with BackgroundCopies() as copies:
            jobs = []
            starts = {}
            history = self.history()
            changed = self.changed_files(updates.names)
            for file in self.files if files is None else files:
                source = self.local_path(file)  # a remote shard is fetched the first time a writer needs its bytes
                header = self.headers[file]
                if file not in changed:  # the whole file, header included, is its source's
                    jobs.append(copies.submit(clone_shard, header, source, dest / file, copies.cancel))
                    continue
                # the record goes where the change is
                starts[file] = start_file(header, dest / file, record, history)
                skip = {n for n in header.tensor_entries() if n in updates.names}
                jobs.append(copies.submit(copy_gaps, header, dest / file, starts[file], skip, copies.cancel))
            for file in starts:
                header = self.headers[file]
                written = patch(header, dest / file, starts[file], updates(file))
                missing = {n for n in header.tensor_entries() if n in updates.names} - set(written)
                if missing:  # a planned tensor that was not computed would leave a hole: never write that
                    raise AssertionError(f"no new value for {sorted(missing)[:3]} in {file}")
            for job in jobs:
                job.result()
        if files is None:
            self.save_shared(dest)


def _history(value: object) -> list:
    return value if isinstance(value, list) else [value]
