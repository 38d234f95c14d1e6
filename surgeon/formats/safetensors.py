"""safetensors, single file or sharded, read and patched at the byte level.

A file is ``<u64 little-endian N><N bytes of JSON header><data>``; data offsets in the header are
relative to the start of the data section. surgeon keeps every tensor's dtype and shape, so data
offsets never move: the output is the input's data section with the updated byte ranges
overwritten, behind a header that differs only in ``__metadata__``. Untouched tensors are copied
as bytes, never decoded.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from ..errors import CheckpointError
from .base import TensorInfo, UpdatesFn, WeightSet, tensor_bytes
from .fileio import BackgroundCopies, copy_range

if TYPE_CHECKING:
    import torch

INDEX_SUFFIX = ".safetensors.index.json"
METADATA_KEY = "surgeon"
_MAX_HEADER = 100 * 1024 * 1024  # the limit the reference implementation enforces

# name -> (torch dtype name, or None where torch has none; bits per element): exactly the dtypes the
# reference reader (the `safetensors` package) knows. A file with any other dtype is refused, as it is
# there. torch is imported only to decode, so that opening, planning and copying do not wait for it.
DTYPES: dict[str, tuple[str | None, int]] = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "C64": ("complex64", 64),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U64": ("uint64", 64),
    "U32": ("uint32", 32),
    "U16": ("uint16", 16),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F6_E2M3": (None, 6),
    "F6_E3M2": (None, 6),
    "F4": (None, 4),
}
_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items() if dtype is not None}


@dataclass
class Header:
    """A parsed safetensors header, keeping the original key order."""

    path: Path
    length: int  # N, the header's byte length
    entries: dict  # the whole JSON object, "__metadata__" included, in file order
    file_size: int

    @property
    def data_start(self) -> int:
        return 8 + self.length

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.entries.get("__metadata__") or {})

    def tensor_entries(self) -> dict[str, dict]:
        return {k: v for k, v in self.entries.items() if k != "__metadata__"}


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header; every problem is a one-line CheckpointError."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: it is only {size} bytes long", path=path)
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER or 8 + length > size:
                raise CheckpointError(
                    f"{path} has a corrupt or truncated safetensors header (it claims {length} header "
                    f"bytes, the file has {size}); re-download or re-save it"
                )
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_header(path, length, raw, size)


def read_header_fd(fd: int, path: Path) -> Header:
    """``read_header`` of a file already opened (and checked) as ``fd``; ``path`` names it in messages."""
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: it is only {size} bytes long", path=path)
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER or 8 + length > size:
            raise CheckpointError(
                f"{path} has a corrupt or truncated safetensors header (it claims {length} header bytes, the file has {size})"
            )
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_header(path, length, raw, size)


def parse_header(path: Path, length: int, raw: bytes, size: int) -> Header:
    """A header from its bytes (``raw``: the N bytes after the length); ``size``: the whole file's size."""
    try:
        entries = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(
            f"{path} has a corrupt safetensors header: {exc.args[0]!r} is listed twice; re-download or re-save it"
        ) from None
    except RecursionError:
        raise CheckpointError(
            f"{path} has a corrupt safetensors header (JSON nested too deeply); re-download or re-save it", path=path
        ) from None
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(
            f"{path} has a corrupt safetensors header (not valid JSON); re-download or re-save it", path=path
        ) from None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)", path=path)
    header = Header(path=path, length=length, entries=entries, file_size=size)
    _validate(header)
    return header


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """JSON objects with a key twice are refused: which of the two entries a reader uses is undefined."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _validate(header: Header) -> None:
    """As strict as the reference reader: known dtypes, byte length = dtype size x shape, and the
    tensors' byte ranges cover the data section exactly (no overlaps, no holes, no trailing bytes)."""
    path, data_size = header.path, header.file_size - header.data_start
    meta = header.entries.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path} has corrupt __metadata__ (must map strings to strings)", path=path)
    spans = []
    for name, entry in header.tensor_entries().items():
        dtype, shape, offsets = (
            (entry.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(entry, dict) else (None,) * 3
        )
        if not (
            isinstance(dtype, str)
            and _naturals(shape)
            and _naturals(offsets)
            and len(offsets) == 2
            and offsets[0] <= offsets[1]
        ):
            raise CheckpointError(
                f"{path} has a corrupt header entry for tensor {name!r}: {json.dumps(entry)[:120]}",
                path=path,
                tensor=name,
            )
        begin, end = offsets
        if dtype not in DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown dtype {dtype[:40]!r} (safetensors knows {', '.join(DTYPES)}): corrupt header"
            )
        bits = math.prod(shape) * DTYPES[dtype][1]
        if bits % 8 or end - begin != bits // 8:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype}: corrupt header",
                path=path,
                tensor=name,
            )
        if end > data_size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end} but the file holds only "
                f"{data_size}; re-download or re-save it"
            )
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin < cursor:
            raise CheckpointError(
                f"{path}: tensor {name!r} overlaps another tensor's bytes: corrupt header", path=path, tensor=name
            )
        if begin > cursor:
            raise CheckpointError(
                f"{path}: data bytes {cursor}-{begin - 1} before tensor {name!r} belong to no tensor (a hole in the data "
                "section, which safetensors readers refuse): corrupt file; re-download or re-save it"
            )
        cursor = end
    if cursor != data_size:
        raise CheckpointError(
            f"{path} has {data_size - cursor} trailing bytes after the last tensor (data bytes {cursor}-{data_size - 1} belong "
            "to no tensor, which safetensors readers refuse): corrupt file; re-download or re-save it"
        )


def _naturals(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def tensor_info(header: Header, name: str, file: str) -> TensorInfo:
    entry = header.entries[name]
    dtype, _ = DTYPES.get(entry["dtype"], (None, None))
    begin, end = entry["data_offsets"]
    return TensorInfo(name, tuple(entry["shape"]), entry["dtype"], dtype, file, end - begin)


def read_tensor(header: Header, name: str) -> torch.Tensor:
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
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def encode_header(entries: dict) -> bytes:
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # pad to 8 bytes, as the reference writer does


def with_metadata(entries: dict, metadata: dict[str, str]) -> dict:
    """A copy of the header whose ``__metadata__`` is ``metadata``, placed first if it was absent."""
    if "__metadata__" in entries:
        return {k: (metadata if k == "__metadata__" else v) for k, v in entries.items()}
    return {"__metadata__": metadata, **entries}


def add_record(metadata: dict[str, str], record: dict) -> dict[str, str]:
    """Append surgeon's record to the history kept under ``__metadata__['surgeon']``."""
    history = []
    if METADATA_KEY in metadata:
        try:
            history = json.loads(metadata[METADATA_KEY])
            history = history if isinstance(history, list) else [history]
        except ValueError:
            history = [metadata[METADATA_KEY]]
    return {**metadata, METADATA_KEY: json.dumps(history + [record], separators=(",", ":"), sort_keys=True)}


def records(metadata: dict[str, str]) -> list[dict]:
    """surgeon's records in a file's metadata (oldest first)."""
    if METADATA_KEY not in metadata:
        return []
    value = json.loads(metadata[METADATA_KEY])
    return value if isinstance(value, list) else [value]


def write_patched(header: Header, dest: Path, updates: dict[str, torch.Tensor], record: dict | None) -> None:
    """Write ``header``'s file to ``dest`` with ``updates`` patched in and ``record`` added."""
    data_start = start_file(header, dest, record)
    copy_gaps(header, dest, data_start, set(updates))
    patch(header, dest, data_start, updates.items())


def start_file(header: Header, dest: Path, record: dict | None) -> int:
    """Create ``dest`` at its final size with ``header`` (plus ``record``) written; returns where its data starts.

    The data section is left as a hole, for :func:`copy_gaps` and :func:`patch` to fill in any order.
    """
    entries = header.entries
    if record is not None:
        entries = with_metadata(entries, add_record(header.metadata, record))
    raw_header = encode_header(entries)
    data_start = 8 + len(raw_header)
    with open(dest, "wb") as out:
        out.write(struct.pack("<Q", len(raw_header)))
        out.write(raw_header)
        out.truncate(data_start + header.file_size - header.data_start)
    return data_start


def spans(header: Header, names) -> list[tuple[int, int]]:
    """The data-section byte ranges of ``names`` in ``header``'s file, in order."""
    return sorted(tuple(header.entries[n]["data_offsets"]) for n in names)


def copy_gaps(header: Header, dest: Path, data_start: int, skip: set[str], cancel=None) -> None:
    """Copy the data section of ``header``'s file into ``dest``, leaving out the tensors in ``skip``."""
    size, pos = header.file_size - header.data_start, 0
    with open(header.path, "rb") as src, open(dest, "r+b") as out:
        for begin, end in spans(header, skip) + [(size, size)]:
            if begin > pos:
                copy_range(src, out, header.data_start + pos, data_start + pos, begin - pos, cancel=cancel)
            pos = max(pos, end)


def patch(header: Header, path: Path, data_start: int, updates) -> list[str]:
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
            os.pwrite(out.fileno(), tensor_bytes(tensor), data_start + entry["data_offsets"][0])
            written.append(name)
    return written


class SafetensorsWeights(WeightSet):
    format = "safetensors"
    patches_in_place = True
    record_slot = True
    shard_suffix = ".safetensors"

    def __init__(self, folder: Path, files: list[str], index: str | None = None) -> None:
        super().__init__(folder, files, index)
        self.headers: dict[str, Header] = {}
        found: dict[str, str] = {}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise CheckpointError(
                    f"missing shard {file}: {index or 'the checkpoint'} lists it but it is not in {folder}"
                )
            header = self.headers[file] = read_header(path)
            for name in header.tensor_entries():
                if name in found:
                    raise CheckpointError(f"tensor {name!r} is in both {found[name]} and {file}")
                found[name] = file
                self._infos[name] = tensor_info(header, name, file)
        self._check_index(found)

    def read(self, name: str) -> torch.Tensor:
        info = self._infos[name]
        return read_tensor(self.headers[info.file], name)

    def raw(self, name: str) -> bytes:
        info = self.tensors[name]
        header = self.headers[info.file]
        begin, end = header.entries[name]["data_offsets"]
        with open(header.path, "rb") as f:
            f.seek(header.data_start + begin)
            return f.read(end - begin)

    def record_texts(self) -> list[tuple[str, list[str]]]:
        # an in-place run adds its record only to the shards whose header has room for it
        out = []
        for file in self.files:
            text = self.metadata(file).get(METADATA_KEY)
            out.append((file, [] if text is None else [text]))
        return out

    def metadata(self, file: str | None = None) -> dict[str, str]:
        return self.headers[file or self.files[0]].metadata

    def save(self, dest: Path, updates: UpdatesFn, record: dict) -> None:
        # Every shard is created at its final size, and all bytes but the changing tensors' are copied
        # on a background thread (kernel-side, so it overlaps torch's import and the math). Meanwhile
        # each new tensor is written into its own, disjoint, range as soon as it is computed, so one
        # tensor's new value is in memory at a time, whatever the size of the shard.
        with BackgroundCopies() as copies:
            jobs = []
            starts = {}
            for file in self.files:
                header = self.headers[file]
                starts[file] = start_file(header, dest / file, record)
                skip = {n for n in header.tensor_entries() if n in updates.names}
                jobs.append(copies.submit(copy_gaps, header, dest / file, starts[file], skip, copies.cancel))
            for file in self.files:
                header = self.headers[file]
                written = patch(header, dest / file, starts[file], updates(file))
                missing = {n for n in header.tensor_entries() if n in updates.names} - set(written)
                if missing:  # a planned tensor that was not computed would leave a hole: never write that
                    raise AssertionError(f"no new value for {sorted(missing)[:3]} in {file}")
            for job in jobs:
                job.result()
        if self.index:
            shutil.copyfile(self.folder / self.index, dest / self.index)
