"""The safetensors header: read and validated as hostile input, encoded back, and surgeon's record in it.

A file is ``<u64 little-endian N><N bytes of JSON header><data>``. The header maps each tensor's name to
its dtype, shape and data offsets (relative to the start of the data section), and may hold a
``__metadata__`` object of strings, where surgeon keeps its record under ``surgeon``. Nothing here
imports torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from ..errors import CheckpointError
from ..files.bounded import MAX_DEPTH, loads, too_deep

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
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return read_header_fd(fd, path)
    finally:
        os.close(fd)


def read_header_fd(fd: int, path: Path) -> Header:
    """``read_header`` of a file already opened (and checked) as ``fd``; ``path`` names it in messages."""
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        length = header_length(path, prefix, size)
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_header(path, length, raw, size)


def header_length(path: Path, prefix: bytes, size: int) -> int:
    """N, from a file's first 8 bytes ``prefix``, checked against the cap and the file's ``size``."""
    if len(prefix) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: it is only {size} bytes long", path=path)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > _MAX_HEADER or 8 + length > size:
        raise CheckpointError(
            f"{path} has a corrupt or truncated safetensors header (it claims {length} header "
            f"bytes, the file has {size}); re-download or re-save it"
        )
    return int(length)


def parse_header(path: Path, length: int, raw: bytes, size: int) -> Header:
    """A header from its bytes (``raw``: the N bytes after the length); ``size``: the whole file's size."""
    if too_deep(raw):  # before json.loads can recurse
        raise CheckpointError(
            f"{path} has a corrupt safetensors header (JSON nested too deeply: over {MAX_DEPTH} levels); "
            "re-download or re-save it",
            path=path,
        )
    try:
        entries = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(
            f"{path} has a corrupt safetensors header: {exc.args[0]!r} is listed twice; re-download or re-save it"
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


def encode_header(entries: dict, length: int | None = None) -> bytes:
    """The header's JSON padded with spaces (which readers allow after the JSON) to a multiple of 8 bytes, as
    the reference writer does, or to exactly ``length`` bytes (at least the JSON's own)."""
    return padded(header_json(entries), length)


def header_json(entries: dict) -> bytes:
    """The header's JSON, compact, unpadded."""
    return json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def padded(text: bytes, length: int | None = None) -> bytes:
    """``text`` followed by spaces up to ``length`` bytes (None: the next multiple of 8)."""
    if length is None:
        length = len(text) + -len(text) % 8
    if length < len(text):
        raise ValueError(f"a header of {len(text)} bytes does not fit in {length}")
    return text + b" " * (length - len(text))


def output_length(source: Header, needed: int, block: int) -> int:
    """The header length N of an output of ``source`` whose JSON takes ``needed`` bytes: the source's own where
    it fits (padded with spaces), else the source's plus whole ``block``s, so that every data byte stays the
    same distance from a block boundary as in the source and a copy-on-write file system can share its block.
    A header that would pass the readers' cap that way is packed instead (padded to 8 bytes only)."""
    if needed <= source.length:
        return source.length
    grown = source.length + -(-(needed - source.length) // block) * block
    return grown if grown <= _MAX_HEADER else needed + -needed % 8


def with_metadata(entries: dict, metadata: dict[str, str]) -> dict:
    """A copy of the header whose ``__metadata__`` is ``metadata``, placed first if it was absent."""
    if "__metadata__" in entries:
        return {k: (metadata if k == "__metadata__" else v) for k, v in entries.items()}
    return {"__metadata__": metadata, **entries}


def add_record(metadata: dict[str, str], record: dict, history: list | None = None) -> dict[str, str]:
    """Append surgeon's record to the history kept under ``__metadata__['surgeon']`` (``history``: the one
    to append to, where the checkpoint's longest is not this file's own: a shard an earlier run left alone)."""
    if history is None:
        history = history_in(metadata)
    return {**metadata, METADATA_KEY: json.dumps(history + [record], separators=(",", ":"), sort_keys=True)}


def history_in(metadata: dict[str, str]) -> list:
    """The history under ``__metadata__['surgeon']`` as a list (text that is not JSON: kept as it is)."""
    if METADATA_KEY not in metadata:
        return []
    try:
        history = loads(metadata[METADATA_KEY], where="surgeon's record")
    except CheckpointError:
        return [metadata[METADATA_KEY]]
    return history if isinstance(history, list) else [history]


def records(metadata: dict[str, str]) -> list[dict]:
    """surgeon's records in a file's metadata (oldest first)."""
    if METADATA_KEY not in metadata:
        return []
    value = loads(metadata[METADATA_KEY], where="surgeon's record")
    return value if isinstance(value, list) else [value]
