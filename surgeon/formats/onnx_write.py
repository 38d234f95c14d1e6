"""Writing an ONNX model by patching bytes, never re-serializing it (see surgeon.formats.onnx).

* the .onnx is copied with the changed initializers' data overwritten in place; an initializer stored
  in another encoding is rewritten as ``raw_data`` (the graph's length prefix follows). Copies of
  shared initializers (the write plan's ``copies``) are appended to the graph, and the nodes that read
  them re-encoded. surgeon's record is a ``metadata_props`` entry appended at the end of the file; an earlier
  ``surgeon`` entry is taken out and its history carried into the new one.
* external data files are copied with only the changed tensors' byte ranges rewritten, at the same
  offsets, so the graph's ``external_data`` entries stay valid (or are re-encoded with the files' new
  names when the model is written under another name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import onnx
import torch

from ..errors import CheckpointError
from ..files.bounded import loads
from . import onnx_wire as wire
from .base import UpdatesFn
from .fileio import copy_file_sparse

if TYPE_CHECKING:
    from .onnx_model import OnnxModel
    from .write_plan import SharedCopy, WritePlan

METADATA_KEY = "surgeon"


class Patch(NamedTuple):
    """New bytes replacing a byte range of the .onnx (an empty range: inserted; no bytes: taken out)."""

    start: int
    end: int
    data: bytes


Edits = list[Patch]


def save(
    weights: OnnxModel,
    dest: Path,
    name: str,
    names: dict[str, str],
    updates: UpdatesFn,
    record: dict,
    write_plan: WritePlan,
    renamed: dict[str, str] | None,
) -> None:
    """``weights`` as ``dest/name``, each external data file as ``dest/names[file]``, the copies of
    ``write_plan`` added; ``renamed``: the new names to write into the graph's ``location`` entries
    (None: the files keep their names)."""
    model = weights.path.name
    if not write_plan.copies:  # each file's new values computed while the one before is written
        write_model(weights, dest / name, dict(updates(model)), record, renamed)
        for file in weights.files[1:]:
            write_data(weights, file, dest / names[file], dict(updates(file)))
        return
    # shared initializers with a copy: their new values go into the .onnx as new initializers
    shared = {c.name: c for c in write_plan.copies}
    changed = {file: dict(updates(file)) for file in weights.files}
    copies = {shared[n]: changed[f].pop(n) for f in changed for n in list(changed[f]) if n in shared}
    write_model(weights, dest / name, changed[model], record, renamed, copies)
    for file in weights.files[1:]:
        write_data(weights, file, dest / names[file], changed[file])


def write_data(weights: OnnxModel, file: str, target: Path, changed: dict[str, torch.Tensor]) -> None:
    """An external data file copied with only the changed tensors' byte ranges rewritten."""
    target.parent.mkdir(parents=True, exist_ok=True)
    copy_file_sparse(weights.folder / file, target)
    if changed:
        with open(target, "r+b") as out:
            for name, tensor in changed.items():
                data = tensor_bytes(weights, name, tensor)
                out.seek(weights.stored[name].offset)
                out.write(data)


def write_model(
    weights: OnnxModel,
    target: Path,
    changed: dict[str, torch.Tensor],
    record: dict,
    renamed: dict[str, str] | None = None,
    copies: dict[SharedCopy, torch.Tensor] | None = None,
) -> None:
    """The .onnx copied to ``target`` with ``changed`` patched in, ``copies`` (each with its new value) added
    and ``record`` appended."""
    layout = weights.layout
    edits = _copy_edits(weights, copies or {}) + _relocation_edits(weights, renamed or {})
    if copies:  # surgeon verify reads the copies' values under their new names
        record = {**record, "copies": {c.name: c.copy for c in copies}}
    edits += _value_edits(weights, changed)
    graph_growth = sum(len(new) - (end - start) for start, end, new in edits)
    if graph_growth:
        g = layout.graph  # its key and length are written again
        length = g.payload_end - g.payload_start + graph_growth
        edits.append(Patch(g.start, g.payload_start, wire.key(wire.MODEL_GRAPH) + wire.varint(length)))
    edits += _old_records(weights)
    with open(weights.path, "rb") as src, open(target, "wb") as out:
        pos = 0
        for start, end, data in sorted(edits):
            wire.copy(src, out, pos, start - pos)
            out.write(data)
            pos = end
        wire.copy(src, out, pos, layout.size - pos)
        out.write(wire.field(wire.MODEL_METADATA, _record_entry(weights, record)))


def _value_edits(weights: OnnxModel, changed: dict[str, torch.Tensor]) -> Edits:
    """The new values: over the old bytes where they are raw, else the initializer re-encoded as raw_data."""
    edits = []
    for name, tensor in changed.items():
        data = tensor_bytes(weights, name, tensor)
        stored = weights.stored[name]
        if stored.in_place:
            edits.append(Patch(stored.offset, stored.offset + stored.length, data))
            continue
        proto = onnx.TensorProto()
        proto.CopyFrom(weights.protos[name])
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            proto.ClearField(f)
        proto.raw_data = data
        assert stored.field is not None  # bytes not in place are an embedded initializer's, whose field was found
        start, end = stored.field
        edits.append(Patch(start, end, wire.field(wire.GRAPH_INITIALIZER, proto.SerializeToString())))
    return edits


def _old_records(weights: OnnxModel) -> Edits:
    """Earlier ``surgeon`` metadata entries, taken out (their history goes into the new one)."""
    return [Patch(e.start, e.end, b"") for e in weights.layout.metadata if e.key == METADATA_KEY]


def _record_entry(weights: OnnxModel, record: dict) -> bytes:
    """The new ``surgeon`` metadata entry: the earlier entries' history, then ``record``."""
    history: list = []
    for entry in weights.layout.metadata:
        if entry.key == METADATA_KEY:
            try:
                old = loads(entry.value, where="surgeon's record")
                history += old if isinstance(old, list) else [old]
            except CheckpointError:  # not JSON: kept as the text it is
                history.append(entry.value)
    return wire.field(1, METADATA_KEY.encode()) + wire.field(
        2, json.dumps(history + [record], separators=(",", ":"), sort_keys=True).encode()
    )


def _copy_edits(weights: OnnxModel, copies: dict[SharedCopy, torch.Tensor]) -> Edits:
    """New initializers for the copies of shared ones (at the end of the graph), and the chosen
    projections' nodes re-encoded to read them."""
    layout, edits = weights.layout, []
    inputs: dict[int, dict[str, str]] = {}
    for shared, tensor in copies.items():
        name = shared.name
        proto = onnx.TensorProto(
            name=shared.copy,
            dims=weights.protos[name].dims,
            data_type=weights.protos[name].data_type,
            raw_data=tensor_bytes(weights, name, tensor),
        )
        end = layout.graph.payload_end  # appended to the graph
        edits.append(Patch(end, end, wire.field(wire.GRAPH_INITIALIZER, proto.SerializeToString())))
        for n in shared.readers:
            inputs.setdefault(n, {})[name] = shared.copy
    for n, renames in inputs.items():
        node = onnx.NodeProto()
        node.CopyFrom(weights.model.graph.node[n])
        for i, x in enumerate(node.input):
            node.input[i] = renames.get(x, x)
        span = layout.nodes[n]
        edits.append(Patch(span.start, span.end, wire.field(wire.GRAPH_NODE, node.SerializeToString())))
    return edits


def _relocation_edits(weights: OnnxModel, renamed: dict[str, str]) -> Edits:
    """External initializers re-encoded with their data files' new names."""
    edits = []
    for t in weights.model.graph.initializer if renamed else ():
        moved = wire.relocated(t, renamed)
        if moved is None:
            continue
        where = weights.layout.tensors.get(t.name)
        if where is None:
            raise CheckpointError(
                f"{weights.path}: initializer {t.name!r} could not be located in the file; re-save the model with onnx.save"
            )
        edits.append(Patch(where.start, where.end, wire.field(wire.GRAPH_INITIALIZER, moved.SerializeToString())))
    return edits


def tensor_bytes(weights: OnnxModel, name: str, tensor: torch.Tensor) -> bytes:
    """The new value's little-endian bytes; it must keep the initializer's shape and dtype."""
    info = weights.tensors[name]
    if tuple(tensor.shape) != info.shape or tensor.dtype != info.torch_dtype:
        raise AssertionError(f"update of {name} changes its shape or dtype")
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
