"""ONNX models, their initializers embedded in the .onnx file or kept in external data files.

Reading never loads external data: each initializer's byte range is located once and read on its
own, so models over 2 GB work. Writing patches bytes instead of re-serializing the model:

* the .onnx is copied with the changed initializers' data overwritten in place (``raw_data``, or
  packed ``float_data``/``double_data``, which are the same little-endian bytes); an initializer
  stored in another encoding is rewritten as ``raw_data`` (the graph's length prefix follows).
  surgeon's record is a ``metadata_props`` entry appended at the end of the file, a valid protobuf
  encoding of one more field of the ModelProto; an earlier ``surgeon`` entry is taken out and its
  history carried into the new one. Everything else stays byte for byte.
* external data files are copied with only the changed tensors' byte ranges rewritten, at the
  same offsets, so the graph's ``external_data`` entries stay valid.

The protobuf wire format is walked directly (``wire.scan``) to find where each initializer's bytes are.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
import torch

from ..errors import CheckpointError, SharedInitializerError, opt
from . import onnx_wire as wire
from .base import TensorInfo, UpdatesFn, WeightSet
from .fileio import copy_file_sparse
from .onnx_checks import aliased, graph_names, refuse_aliased, refuse_self_location

METADATA_KEY = "surgeon"

# ONNX TensorProto.DataType -> (torch dtype, bytes per element)
DTYPES: dict[int, tuple[torch.dtype, int]] = {
    onnx.TensorProto.FLOAT: (torch.float32, 4),
    onnx.TensorProto.FLOAT16: (torch.float16, 2),
    onnx.TensorProto.BFLOAT16: (torch.bfloat16, 2),
    onnx.TensorProto.DOUBLE: (torch.float64, 8),
    onnx.TensorProto.INT64: (torch.int64, 8),
    onnx.TensorProto.INT32: (torch.int32, 4),
    onnx.TensorProto.INT16: (torch.int16, 2),
    onnx.TensorProto.INT8: (torch.int8, 1),
    onnx.TensorProto.UINT64: (torch.uint64, 8),
    onnx.TensorProto.UINT32: (torch.uint32, 4),
    onnx.TensorProto.UINT16: (torch.uint16, 2),
    onnx.TensorProto.UINT8: (torch.uint8, 1),
    onnx.TensorProto.BOOL: (torch.bool, 1),
    onnx.TensorProto.FLOAT8E4M3FN: (torch.float8_e4m3fn, 1),
    onnx.TensorProto.FLOAT8E5M2: (torch.float8_e5m2, 1),
}
# nodes that pass an initializer's values on to others (a copy read through them must reach only the chosen projections)
_PASS_ON = frozenset(
    ("Identity", "Transpose", "Cast", "CastLike", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Split", "Slice", "Gather",
     "Concat", "Expand", "Tile", "DequantizeLinear")
)
_FLOATS = frozenset((onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE))
_SMALL = 4096  # constants the graph walker may read (shapes, axes, split sizes)


@dataclass(frozen=True)
class _Stored:
    """Where one initializer's data lives."""

    file: str  # relative to the model's folder: the .onnx itself or an external data file
    offset: int  # absolute byte offset of the data in that file
    length: int
    in_place: bool  # the bytes are the tensor's little-endian values and can be overwritten as they are
    field: tuple[int, int] | None = None  # embedded: the initializer's whole field in the .onnx



def open_onnx(path: str | Path) -> OnnxWeights:
    return OnnxWeights(Path(path))


class OnnxWeights(WeightSet):
    format = "onnx"

    def __init__(self, path: Path) -> None:
        super().__init__(path.parent, [path.name], None)
        self.path = path
        self.model = _load(path)
        self.layout = wire.scan(path)
        self._stored: dict[str, _Stored] = {}
        self._protos: dict[str, onnx.TensorProto] = {}
        # shared initializers the plan changes for some of their readers: name -> (the copy's name,
        # the nodes that read the copy instead); see check_plan
        self.copies: dict[str, tuple[str, list[int]]] = {}
        external: list[str] = []
        for t in self.model.graph.initializer:
            if t.data_type not in DTYPES:
                continue  # strings, complex and packed 4-bit types: never projections
            dtype, itemsize = DTYPES[t.data_type]
            nbytes = math.prod(t.dims) * itemsize  # exact: absurd dims (2**40 x 2**40) never wrap to a small size
            if t.data_location == onnx.TensorProto.EXTERNAL:
                stored = self._external(t, nbytes)
                if stored.file not in external:
                    external.append(stored.file)
            else:
                stored = self._embedded(t, nbytes)
            name = onnx.TensorProto.DataType.Name(t.data_type)
            self._infos[t.name] = TensorInfo(t.name, tuple(int(d) for d in t.dims), name, str(dtype).removeprefix("torch."), stored.file, nbytes)
            self._stored[t.name] = stored
            self._protos[t.name] = t
        self.files = [path.name] + external
        # 2-D float weights kept in Constant nodes: read and patched in place like embedded initializers
        self.constants: dict[str, onnx.TensorProto] = {}
        for node in self.model.graph.node:
            found = self.layout.constants.get(node.output[0]) if node.op_type == "Constant" and len(node.output) == 1 else None
            value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            name = node.output[0] if found else ""
            if found is None or value is None or len(value.dims) != 2 or name in self._infos or value.data_type not in _FLOATS:
                continue
            data_field, dstart, dend, one_piece = found
            dtype, itemsize = DTYPES[value.data_type]
            nbytes = math.prod(value.dims) * itemsize
            if data_field != wire.TENSOR_RAW or not one_piece or dend - dstart != nbytes:
                continue  # only raw bytes are patched in place; others stay unsupported (see the walker's message)
            proto = onnx.TensorProto()
            proto.CopyFrom(value)
            proto.name = name
            self._infos[name] = TensorInfo(name, tuple(int(d) for d in value.dims), onnx.TensorProto.DataType.Name(value.data_type),
                                           str(dtype).removeprefix("torch."), path.name, nbytes)
            self._stored[name] = _Stored(path.name, dstart, nbytes, True)
            self._protos[name] = proto
            self.constants[name] = proto

    # --- where the bytes are ---------------------------------------------------------------
    def _embedded(self, t: onnx.TensorProto, nbytes: int) -> _Stored:
        entry = self.layout.tensors.get(t.name)
        if entry is None:
            raise CheckpointError(f"{self.path}: initializer {t.name!r} could not be located in the file; re-save the model with onnx.save")
        fstart, fend, data_field, dstart, dend, one_piece = entry
        raw = data_field == wire.TENSOR_RAW or (data_field == wire.TENSOR_FLOAT and t.data_type == onnx.TensorProto.FLOAT) or (
            data_field == wire.TENSOR_DOUBLE and t.data_type == onnx.TensorProto.DOUBLE
        )
        if data_field is None and nbytes == 0:
            raw = True
        if data_field is None and nbytes:
            raise CheckpointError(f"{self.path}: initializer {t.name!r} holds no data for shape {list(t.dims)}: the model is corrupt")
        if raw and one_piece and dend - dstart != nbytes:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} holds {dend - dstart} bytes for shape {list(t.dims)}: the model is corrupt"
            )
        return _Stored(self.path.name, dstart, dend - dstart, raw and one_piece, (fstart, fend))

    def _external(self, t: onnx.TensorProto, nbytes: int) -> _Stored:
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        rel = PurePosixPath(location.replace("\\", "/"))
        outside = CheckpointError(
            f"{self.path}: initializer {t.name!r} points to external data {location[:80]!r}, which is not a path inside the model's folder"
        )
        if not location or "\x00" in location or rel.is_absolute() or ".." in rel.parts or rel.parts[:1] and ":" in rel.parts[0]:
            raise outside
        file = self.folder / rel
        try:  # a link that leads out of the folder is outside too: surgeon never reads (or writes) there
            if file.exists() and self.folder.resolve() not in file.resolve().parents:
                raise outside
        except (OSError, ValueError):
            raise outside from None
        try:
            offset = int(info.get("offset", 0))
            length = int(info.get("length", nbytes))
        except ValueError:
            raise CheckpointError(f"{self.path}: initializer {t.name!r} has a malformed external data offset or length") from None
        refuse_self_location(self.path, file, t.name, location)
        if not file.is_file():
            raise CheckpointError(
                f"missing external data file {location} (initializer {t.name!r} of {self.path.name}): "
                f"it must be in {self.folder} as the model says; copy it there or re-export the model"
            )
        if length != nbytes:
            raise CheckpointError(f"{self.path}: initializer {t.name!r} has {length} bytes of external data for shape {list(t.dims)}: the model is corrupt")
        size = file.stat().st_size
        if offset < 0 or offset + length > size:
            raise CheckpointError(
                f"external data file {location} is truncated: initializer {t.name!r} needs bytes {offset}-{offset + length} "
                f"but the file has {size}; re-download or re-export the model"
            )
        return _Stored(str(rel), offset, length, True)

    # --- WeightSet ----------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        info, stored = self._infos[name], self._stored[name]
        if not stored.in_place:  # varint-encoded (e.g. float16 in int32_data): let onnx decode it
            try:
                array = onnx.numpy_helper.to_array(self._protos[name])
            except ValueError:  # more or fewer values than its shape holds
                raise CheckpointError(f"{self.path}: initializer {name!r} does not hold the values of its shape {list(info.shape)}: "
                                      "the model is corrupt") from None
            return _to_torch(array, info)
        if stored.length == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        buf = bytearray(stored.length)
        with open(self.folder / stored.file, "rb") as f:
            f.seek(stored.offset)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{stored.file} ended while reading initializer {name!r}: the file is truncated")
        return torch.frombuffer(buf, dtype=_dtype(info)).reshape(info.shape)

    def describe(self) -> str:
        extra = len(self.files) - 1
        return f"onnx ({self.path.name}" + (f" + {extra} external data file{'s' if extra > 1 else ''})" if extra else ")")

    def const(self, name: str) -> np.ndarray | None:
        info = self._infos.get(name)
        if info is None or info.nbytes > _SMALL * 8 or info.torch_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            return None
        return self.read(name).numpy()

    def check_plan(self, plan, detection) -> list[str]:
        """Refuse to change an initializer that nodes outside the plan read too (``detection.graph``:
        the graph facts of surgeon.detect.onnx). Zeroing a bias that is all zero bytes already (an
        untrained model's biases, which exporters merge into one initializer with every other zero
        vector of that size) leaves it as it is: no change, so no conflict."""
        found = detection.graph
        if found is None:
            return []
        weights = {c.projection.weight.tensor for c in plan.changes}
        unchanged: list[str] = []
        allowed: dict[str, set[int]] = {}
        for change in plan.changes:
            proj, users = change.projection, found.users[(change.block.module, change.role)]
            allowed.setdefault(proj.weight.tensor, set()).update(users["weight"])
            if plan.options.zero_bias and proj.bias is not None:
                allowed.setdefault(proj.bias.tensor, set()).update(users["bias"])
        graph = found.graph
        refuse_aliased(plan.tensors(), aliased(self.folder, [(n, st.file, st.offset, st.length) for n, st in self._stored.items()
                                                             if st.file != self.path.name]))
        self.copies = {}
        notes: list[str] = []
        behind = _unchosen_readers(plan, detection)
        for name in plan.tensors():
            others = [n for n in graph.consumers.get(name, []) if n not in allowed.get(name, set())]
            # a node on the way to a chosen projection (an Identity the exporter put there) that feeds another too
            through = [label for label, nodes in behind.get(name, {}).items() if nodes & allowed.get(name, set())]
            leak = None if others or through else _passed_on(name, allowed.get(name, set()), graph)
            if not others and not through and not leak and name not in graph.outputs:
                continue
            if name not in weights and self._all_zero_bytes(name):
                unchanged.append(name)
                continue
            what = through + [f"block {found.owners[n][0]} ({found.owners[n][1]})" if n in found.owners else graph.describe(n) for n in others]
            what = list(dict.fromkeys(what)) + (["a graph output"] if name in graph.outputs else [])
            if leak:  # read only by the chosen projections' nodes, but one of those passes it on to others
                raise SharedInitializerError(
                    f"initializer {name!r} is read through nodes that feed more than the projections chosen ({leak}), "
                    "so changing it would change those too; leave those projections out"
                )
            shown = ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")
            why = self._copy(name, allowed.get(name, set()), graph)
            if why is None:
                copy = self.copies[name][0]
                notes.append(f"initializer {name!r} is shared with {shown}: the chosen projections read a new copy of it, {copy!r}, and the others keep the original")
                continue
            is_bias = any(c.projection.bias is not None and c.projection.bias.tensor == name for c in plan.changes)
            fix = f"select them too ({opt('layers')}/{opt('stack')}/{opt('attention')})" + (f", or keep the biases ({opt('bias', 'keep')})" if is_bias else "")
            raise SharedInitializerError(
                f"initializer {name!r} is shared: besides the projections chosen, {shown} read{'s' if len(what) == 1 else ''} it, "
                f"so changing it would change them too, and the chosen ones cannot have a copy of their own ({why}); {fix}, or leave those projections out"
            )
        if not unchanged:
            return notes
        shown = ", ".join(unchanged[:3]) + (f" and {len(unchanged) - 3} more" if len(unchanged) > 3 else "")
        return notes + [f"bias initializer{'s' if len(unchanged) > 1 else ''} {shown}, shared with other nodes, "
                f"{'are' if len(unchanged) > 1 else 'is'} zero already: zeroing the chosen heads' biases leaves {'them' if len(unchanged) > 1 else 'it'} as {'they were' if len(unchanged) > 1 else 'it was'}"]

    def _copy(self, name: str, readers: set[int], graph) -> str | None:
        """Give the chosen projections' nodes (``readers``) their own copy of initializer ``name``:
        None when that is exact (recorded in ``self.copies``), else why not. Exact: the nodes that read
        ``name`` directly are renamed, and whatever passes its value on (Identity, Transpose, Split, ...)
        feeds only the chosen projections."""
        direct = [n for n in graph.consumers.get(name, []) if n in readers]
        if len(self.layout.nodes) != len(graph.nodes):
            return "its nodes could not be located in the file"
        if not direct:
            return "no node of theirs reads it directly"
        for n in direct:
            if name not in graph.nodes[n].input:
                return f"{graph.describe(n)} reads it inside a subgraph"
        leak = _passed_on(name, readers, graph)
        if leak:
            return leak
        extra = sum(self._infos[n].nbytes for n in self.copies) + self._infos[name].nbytes
        if self.layout.size + extra >= 2**31 - 2**20:
            return "the copy would take the .onnx past protobuf's 2 GiB"
        made = {c for c, _ in self.copies.values()}
        copy, i = f"{name}.surgeon_copy", 1
        while copy in self._names or copy in graph.inits or copy in made:
            i += 1
            copy = f"{name}.surgeon_copy{i}"
        self.copies[name] = (copy, direct)
        return None

    @functools.cached_property
    def _names(self) -> set[str]:
        """Every name the graph uses (a copy's name must be none of them)."""
        return graph_names(self.model.graph)

    def _all_zero_bytes(self, name: str) -> bool:
        """Every byte of the initializer is 0 (+0.0; -0.0 is not, as zeroing would change its bytes)."""
        info = self._infos.get(name)
        if info is None or info.torch_dtype is None:
            return False
        return not bool(self.read(name).reshape(-1).view(torch.uint8).any())

    def save(self, dest: Path, updates: UpdatesFn, record: dict) -> None:
        self._save(dest, self.path.name, {f: f for f in self.files[1:]}, updates, record, None)

    def save_as(self, dest: Path, name: str, updates: UpdatesFn, record: dict) -> list[str]:
        """The model as ``dest/name``, its external data files renamed beside it
        (``wire.renamed_data_files``) and the graph's ``location`` entries rewritten to match."""
        names = wire.renamed_data_files(self.files[1:], self.path.name, name)
        self._save(dest, name, names, updates, record, names)
        return [name, *names.values()]

    def _save(self, dest: Path, name: str, names: dict[str, str], updates: UpdatesFn, record: dict, renamed: dict[str, str] | None) -> None:
        if not self.copies:  # each file's new values computed while the one before is written
            self._write_model(dest / name, dict(updates(self.path.name)), record, renamed)
            for file in self.files[1:]:
                self._write_data(file, dest / names[file], dict(updates(file)))
            return
        # shared initializers with a copy: their new values go into the .onnx as new initializers
        changed = {file: dict(updates(file)) for file in self.files}
        copies = {n: changed[f].pop(n) for f in changed for n in list(changed[f]) if n in self.copies}
        self._write_model(dest / name, changed[self.path.name], record, renamed, copies)
        for file in self.files[1:]:
            self._write_data(file, dest / names[file], changed[file])

    def _write_data(self, file: str, target: Path, changed: dict[str, torch.Tensor]) -> None:
        """An external data file copied with only the changed tensors' byte ranges rewritten."""
        target.parent.mkdir(parents=True, exist_ok=True)
        copy_file_sparse(self.folder / file, target)
        if changed:
            with open(target, "r+b") as out:
                for name, tensor in changed.items():
                    data = self._bytes(name, tensor)
                    out.seek(self._stored[name].offset)
                    out.write(data)

    # --- writing the .onnx ----------------------------------------------------------------------
    def _write_model(
        self, target: Path, changed: dict[str, torch.Tensor], record: dict, renamed: dict[str, str] | None = None,
        copies: dict[str, torch.Tensor] | None = None,
    ) -> None:
        layout = self.layout
        edits = self._copy_edits(copies or {}) + self._relocation_edits(renamed or {})
        graph_growth = sum(len(new) - (end - start) for start, end, new in edits)
        if copies:  # surgeon verify reads the copies' values under their new names
            record = {**record, "copies": {name: self.copies[name][0] for name in copies}}
        for name, tensor in changed.items():
            data = self._bytes(name, tensor)
            stored = self._stored[name]
            if stored.in_place:
                edits.append((stored.offset, stored.offset + stored.length, data))
                continue
            proto = onnx.TensorProto()
            proto.CopyFrom(self._protos[name])
            for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                proto.ClearField(f)
            proto.raw_data = data
            start, end = stored.field  # type: ignore[misc]
            new = wire.field(wire.GRAPH_INITIALIZER, proto.SerializeToString())
            edits.append((start, end, new))
            graph_growth += len(new) - (end - start)
        if graph_growth:
            gstart, pstart, pend = layout.graph
            edits.append((gstart, pstart, wire.key(wire.MODEL_GRAPH) + wire.varint(pend - pstart + graph_growth)))
        history: list = []
        for start, end, key, value in layout.metadata:
            if key == METADATA_KEY:
                edits.append((start, end, b""))
                try:
                    old = json.loads(value)
                    history += old if isinstance(old, list) else [old]
                except ValueError:
                    history.append(value)
        entry = wire.field(1, METADATA_KEY.encode()) + wire.field(2, json.dumps(history + [record], separators=(",", ":"), sort_keys=True).encode())
        with open(self.path, "rb") as src, open(target, "wb") as out:
            pos = 0
            for start, end, data in sorted(edits):
                wire.copy(src, out, pos, start - pos)
                out.write(data)
                pos = end
            wire.copy(src, out, pos, layout.size - pos)
            out.write(wire.field(wire.MODEL_METADATA, entry))

    def _copy_edits(self, copies: dict[str, torch.Tensor]) -> list[tuple[int, int, bytes]]:
        """New initializers for the copies of shared ones (at the end of the graph), and the chosen
        projections' nodes re-encoded to read them."""
        layout, edits = self.layout, []
        inputs: dict[int, dict[str, str]] = {}
        for name, tensor in copies.items():
            copy, readers = self.copies[name]
            proto = onnx.TensorProto(name=copy, dims=self._protos[name].dims, data_type=self._protos[name].data_type, raw_data=self._bytes(name, tensor))
            edits.append((layout.graph[2], layout.graph[2], wire.field(wire.GRAPH_INITIALIZER, proto.SerializeToString())))
            for n in readers:
                inputs.setdefault(n, {})[name] = copy
        for n, renames in inputs.items():
            node = onnx.NodeProto()
            node.CopyFrom(self.model.graph.node[n])
            for i, x in enumerate(node.input):
                node.input[i] = renames.get(x, x)
            start, end = layout.nodes[n]
            edits.append((start, end, wire.field(wire.GRAPH_NODE, node.SerializeToString())))
        return edits

    def _relocation_edits(self, renamed: dict[str, str]) -> list[tuple[int, int, bytes]]:
        """External initializers re-encoded with their data files' new names."""
        edits = []
        for t in self.model.graph.initializer if renamed else ():
            moved = _relocated(t, renamed)
            if moved is None:
                continue
            span = self.layout.tensors.get(t.name)
            if span is None:
                raise CheckpointError(f"{self.path}: initializer {t.name!r} could not be located in the file; re-save the model with onnx.save")
            edits.append((span[0], span[1], wire.field(wire.GRAPH_INITIALIZER, moved.SerializeToString())))
        return edits

    def _bytes(self, name: str, tensor: torch.Tensor) -> bytes:
        info = self._infos[name]
        if tuple(tensor.shape) != info.shape or tensor.dtype != info.torch_dtype:
            raise AssertionError(f"update of {name} changes its shape or dtype")
        return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def surgeon_records(model: onnx.ModelProto) -> list[dict]:
    """surgeon's records in a model's ``metadata_props`` (oldest first)."""
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            value = json.loads(p.value)
            return value if isinstance(value, list) else [value]
    return []


def _passed_on(name: str, readers: set[int], graph) -> str | None:
    """Where a node among ``readers`` that passes initializer ``name`` on (Identity, Transpose,
    Split, ...) feeds a node outside them or a graph output, so that changing what it reads changes
    more than the chosen projections; None where it does not."""
    todo = [n for n in graph.consumers.get(name, []) if n in readers]
    seen = set(todo)
    while todo:
        n = todo.pop()
        if graph.nodes[n].op_type not in _PASS_ON:
            continue
        for out in graph.nodes[n].output:
            if out in graph.outputs:
                return f"{graph.describe(n)} passes it on to a graph output"
            for c in graph.consumers.get(out, []):
                if c not in readers:
                    return f"{graph.describe(n)} passes it on to {graph.describe(c)} too"
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
    return None


def _unchosen_readers(plan, detection) -> dict[str, dict[str, set[int]]]:
    """initializer -> {"block X (role)": the nodes through which that unchosen projection reads it}."""
    chosen = {(c.block.module, c.role) for c in plan.changes}
    out: dict[str, dict[str, set[int]]] = {}
    for block in detection.blocks:
        for proj in block.projections:
            users = detection.graph.users.get((block.module, proj.role))
            if (block.module, proj.role) in chosen or users is None:
                continue
            label = f"block {block.label} ({proj.role})"
            out.setdefault(proj.weight.tensor, {}).setdefault(label, set()).update(users["weight"])
            if proj.bias is not None:
                out.setdefault(proj.bias.tensor, {}).setdefault(label, set()).update(users["bias"])
    return out


def _relocated(t: onnx.TensorProto, renamed: dict[str, str]) -> onnx.TensorProto | None:
    """``t`` with its external data ``location`` renamed, or None where it does not move."""
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


# --- reading the model ---------------------------------------------------------------------------
def _load(path: Path) -> onnx.ModelProto:
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types for bad bytes
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable ONNX model ({reason}); re-export or re-download it") from None
    if not model.ir_version or not model.graph.node:
        raise CheckpointError(f"{path} is not an ONNX model (it has no graph); re-export or re-download it")
    return model


def _to_torch(array: np.ndarray, info: TensorInfo) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype.kind in "biuf" and array.dtype.name not in ("bfloat16",) and array.dtype.itemsize == torch.empty((), dtype=info.torch_dtype).element_size():
        try:
            return torch.from_numpy(array.copy()).view(_dtype(info)).reshape(info.shape)
        except TypeError:
            pass
    raw = array.view(np.uint8).copy()
    return torch.from_numpy(raw).view(_dtype(info)).reshape(info.shape)


def _dtype(info: TensorInfo) -> torch.dtype:
    """The torch dtype of an initializer surgeon reads (one without an equivalent is never read)."""
    dtype = info.torch_dtype
    if dtype is None:
        raise CheckpointError(f"initializer {info.name!r} has dtype {info.dtype}, which torch cannot hold")
    return dtype


