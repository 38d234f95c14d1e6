"""The protobuf encoding of an .onnx file, read and written at byte level (no full parse, no copy of the weights)."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

from ..errors import CheckpointError
from .fileio import copy_range

if TYPE_CHECKING:
    import onnx

    Bytes = bytes | mmap.mmap  # an .onnx file's bytes: mapped, or in memory

# Field numbers of onnx.proto that the byte-level scan needs.
MODEL_GRAPH, MODEL_METADATA = 7, 14
GRAPH_NODE, GRAPH_INITIALIZER = 1, 5
NODE_OUTPUT, NODE_OP_TYPE, NODE_ATTRIBUTE = 2, 4, 5
ATTR_NAME, ATTR_TENSOR = 1, 5
TENSOR_NAME, TENSOR_RAW, TENSOR_FLOAT, TENSOR_DOUBLE = 8, 9, 4, 10
TENSOR_DATA_FIELDS = {4, 5, 6, 7, 9, 10, 11}
LEN = 2  # wire type of length-delimited fields


class Field(NamedTuple):
    """One field of a protobuf message, where it lies in the bytes."""

    number: int
    wire: int  # wire type (LEN: length-delimited)
    start: int  # the field's first byte (its key)
    payload_start: int
    payload_end: int  # also the field's end


class Span(NamedTuple):
    """A field's bytes: start (its key) and end."""

    start: int
    end: int


class Data(NamedTuple):
    """Where a tensor's data lies: the field that holds it (None: no data), its payload, whether in one piece (an
    unpacked repeated field, one element per field, cannot be patched in place)."""

    field: int | None
    start: int
    end: int
    one_piece: bool


class Initializer(NamedTuple):
    """Where one initializer lies in the .onnx: its whole field, and its data."""

    start: int
    end: int
    data: Data


class MetadataEntry(NamedTuple):
    """One top-level ``metadata_props`` entry: its field start and end, key and value."""

    start: int
    end: int
    key: str
    value: str


@dataclass
class Layout:
    """Byte positions in the .onnx found by scanning its protobuf encoding."""

    size: int
    graph: Field  # the model's graph field
    tensors: dict[str, Initializer]  # by initializer name
    metadata: list[MetadataEntry]  # top-level metadata_props
    nodes: list[Span]  # the graph's nodes in order
    constants: dict[str, Data]  # a Constant node's output -> where its value tensor's data is


def renamed_data_files(files: list[str], model_name: str, new_name: str) -> dict[str, str]:
    """New names for an .onnx's external data files when the model is written as ``new_name``: flat
    names beside the new file, each starting with ``new_name`` (``model.onnx.data`` -> ``out.onnx.data``;
    ``weights/part0.bin`` -> ``out.onnx.weights_part0.bin``), so none can be the input's own files."""
    out = {}
    for rel in files:
        if "/" not in rel and rel.startswith(model_name) and rel != model_name:
            out[rel] = new_name + rel[len(model_name) :]
        else:
            out[rel] = f"{new_name}.{rel.replace('/', '_')}"
    if len(set(out.values())) < len(out) or new_name in out.values():
        out = {rel: f"{new_name}.{i}.data" for i, rel in enumerate(files)}
    return out


class Corrupt(Exception):
    pass


def scan(path: Path) -> Layout:
    """Find the graph, each initializer's data and surgeon's metadata entries in the .onnx bytes."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return scan_buffer(buf)
    except Corrupt as exc:
        raise CheckpointError(f"{path} has a corrupt protobuf encoding ({exc}); re-export or re-download it") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def scan_buffer(buf: Bytes) -> Layout:
    size = len(buf)
    graph = None
    metadata = []
    for f in fields(buf, 0, size):
        if f.number == MODEL_GRAPH and f.wire == LEN:
            if graph is not None:
                raise Corrupt("the model has its graph in two pieces")
            graph = f
        elif f.number == MODEL_METADATA and f.wire == LEN:
            entry = {
                n: bytes(buf[s:e]).decode("utf-8", "replace")
                for n, w, _, s, e in fields(buf, f.payload_start, f.payload_end)
                if w == LEN
            }
            metadata.append(MetadataEntry(f.start, f.payload_end, entry.get(1, ""), entry.get(2, "")))
    if graph is None:
        raise Corrupt("no graph")
    tensors = {}
    nodes = []
    constants: dict[str, Data] = {}
    for number, wire, start, pstart, pend in fields(buf, graph.payload_start, graph.payload_end):
        if number == GRAPH_NODE and wire == LEN:
            nodes.append(Span(start, pend))
            _constant(buf, pstart, pend, constants)
        if number != GRAPH_INITIALIZER or wire != LEN:
            continue
        name, data_field, span, pieces = "", None, (pend, pend), 0
        for n, w, _, s, e in fields(buf, pstart, pend):
            if n == TENSOR_NAME and w == LEN:
                name = bytes(buf[s:e]).decode("utf-8")
            elif n in TENSOR_DATA_FIELDS:
                # an unpacked repeated field (one element per field) cannot be patched in place
                pieces += 1 if w == LEN else 2
                data_field, span = n, (s, e)
        tensors[name] = Initializer(start, pend, Data(data_field, span[0], span[1], pieces <= 1))
    return Layout(size, graph, tensors, metadata, nodes, constants)


def _constant(buf: Bytes, start: int, end: int, out: dict[str, Data]) -> None:
    """Where a Constant node's ``value`` tensor keeps its data (weights that exporters or optimizers
    put in Constant nodes instead of initializers)."""
    op, outputs, value = "", [], None
    for n, w, _, s, e in fields(buf, start, end):
        if n == NODE_OP_TYPE and w == LEN:
            op = bytes(buf[s:e]).decode("utf-8", "replace")
        elif n == NODE_OUTPUT and w == LEN:
            outputs.append(bytes(buf[s:e]).decode("utf-8", "replace"))
        elif n == NODE_ATTRIBUTE and w == LEN:
            attr = {an: (as_, ae) for an, aw, _, as_, ae in fields(buf, s, e) if aw == LEN}
            if ATTR_NAME in attr and bytes(buf[slice(*attr[ATTR_NAME])]) == b"value" and ATTR_TENSOR in attr:
                value = attr[ATTR_TENSOR]
    if op != "Constant" or len(outputs) != 1 or value is None:
        return
    data_field, span, pieces = None, (value[1], value[1]), 0
    for n, w, _, s, e in fields(buf, value[0], value[1]):
        if n in TENSOR_DATA_FIELDS:
            pieces += 1 if w == LEN else 2
            data_field, span = n, (s, e)
    out[outputs[0]] = Data(data_field, span[0], span[1], pieces <= 1)


def fields(buf: Bytes, start: int, end: int) -> Iterator[Field]:
    """Each field in buf[start:end]."""
    pos = start
    while pos < end:
        fstart = pos
        key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            pstart = pos
            _, pos = read_varint(buf, pos, end)
        elif wire == 1:
            pstart, pos = pos, pos + 8
        elif wire == LEN:
            length, pos = read_varint(buf, pos, end)
            pstart, pos = pos, pos + length
        elif wire == 5:
            pstart, pos = pos, pos + 4
        else:
            raise Corrupt(f"unknown wire type {wire} at byte {fstart}")
        if pos > end or number == 0:
            raise Corrupt(f"a field at byte {fstart} runs past its message")
        yield Field(number, wire, fstart, pstart, pos)


def read_varint(buf: Bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise Corrupt(f"truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Corrupt(f"overlong varint at byte {pos}")


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(number: int) -> bytes:
    return varint(number << 3 | LEN)


def field(number: int, payload: bytes) -> bytes:
    return key(number) + varint(len(payload)) + payload


def copy(src: BinaryIO, out: BinaryIO, offset: int, count: int) -> None:
    """Append ``count`` bytes of ``src`` at ``offset`` to ``out``."""
    copy_range(src, out, offset, out.tell(), count)


def relocated(t: onnx.TensorProto, renamed: dict[str, str]) -> onnx.TensorProto | None:
    """``t`` with its external data ``location`` renamed, or None where it does not move."""
    import onnx

    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    proto = onnx.TensorProto()
    proto.CopyFrom(t)
    moved = False
    for e in proto.external_data:
        new = renamed.get(str(PurePosixPath(e.value.replace("\\", "/")))) if e.key == "location" else None
        if new is not None:
            e.value, moved = new, True
    return proto if moved else None
