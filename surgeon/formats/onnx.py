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

The protobuf wire format is walked directly (``wire.scan``) to find where each initializer's bytes are;
writing is in ``onnx_write``, the checks of a plan against shared initializers in ``onnx_sharing``.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from ..errors import CheckpointError
from ..files.bounded import loads
from ..files.folder import file_in
from ..vocab.change import PlanView
from . import onnx_wire as wire
from . import onnx_write
from .base import TensorInfo, UpdatesFn, WeightSet
from .onnx_checks import graph_names, refuse_self_location
from .onnx_model import Stored
from .onnx_write import METADATA_KEY
from .write_plan import WritePlan

if TYPE_CHECKING:
    from ..vocab.detection import Detection

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
_FLOATS = frozenset(
    (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
)
_SMALL = 4096  # constants the graph walker may read (shapes, axes, split sizes)


def open_onnx(path: str | Path) -> OnnxWeights:
    return OnnxWeights(Path(path))


class OnnxWeights(WeightSet):
    format = "onnx"
    patches_in_place = False  # an .onnx is rewritten whole (its graph's length prefixes move)
    rewrites_whole_tensors = False  # only Q/K/V initializers are patched in a graph
    graph = True
    record_slot = True

    def __init__(self, path: Path) -> None:
        super().__init__(path.parent, [path.name], None)
        self.path = path
        self.model = _load(path)
        self.layout = wire.scan(path)
        self.stored: dict[str, Stored] = {}
        self.protos: dict[str, onnx.TensorProto] = {}
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
            self._infos[t.name] = TensorInfo(
                t.name, tuple(int(d) for d in t.dims), name, str(dtype).removeprefix("torch."), stored.file, nbytes
            )
            self.stored[t.name] = stored
            self.protos[t.name] = t
        self.files = [path.name] + external
        self.constants: dict[str, onnx.TensorProto] = {}
        self._find_constants()

    def _find_constants(self) -> None:
        """2-D float weights kept in Constant nodes: read and patched in place like embedded initializers."""
        path = self.path
        for node in self.model.graph.node:
            found = (
                self.layout.constants.get(node.output[0])
                if node.op_type == "Constant" and len(node.output) == 1
                else None
            )
            value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            name = node.output[0] if found else ""
            if (
                found is None
                or value is None
                or len(value.dims) != 2
                or name in self._infos
                or value.data_type not in _FLOATS
            ):
                continue
            data_field, dstart, dend, one_piece = found  # a wire.Data
            dtype, itemsize = DTYPES[value.data_type]
            nbytes = math.prod(value.dims) * itemsize
            if data_field != wire.TENSOR_RAW or not one_piece or dend - dstart != nbytes:
                continue  # only raw bytes are patched in place; others stay unsupported (see the walker's message)
            proto = onnx.TensorProto()
            proto.CopyFrom(value)
            proto.name = name
            self._infos[name] = TensorInfo(
                name,
                tuple(int(d) for d in value.dims),
                onnx.TensorProto.DataType.Name(value.data_type),
                str(dtype).removeprefix("torch."),
                path.name,
                nbytes,
            )
            self.stored[name] = Stored(path.name, dstart, nbytes, True)
            self.protos[name] = proto
            self.constants[name] = proto

    # --- where the bytes are ---------------------------------------------------------------
    def _embedded(self, t: onnx.TensorProto, nbytes: int) -> Stored:
        entry = self.layout.tensors.get(t.name)
        if entry is None:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} could not be located in the file; re-save the model with onnx.save"
            )
        fstart, fend, (data_field, dstart, dend, one_piece) = entry  # a wire.Initializer
        raw = (
            data_field == wire.TENSOR_RAW
            or (data_field == wire.TENSOR_FLOAT and t.data_type == onnx.TensorProto.FLOAT)
            or (data_field == wire.TENSOR_DOUBLE and t.data_type == onnx.TensorProto.DOUBLE)
        )
        if data_field is None and nbytes == 0:
            raw = True
        if data_field is None and nbytes:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} holds no data for shape {list(t.dims)}: the model is corrupt"
            )
        if raw and one_piece and dend - dstart != nbytes:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} holds {dend - dstart} bytes for shape {list(t.dims)}: the model is corrupt"
            )
        return Stored(self.path.name, dstart, dend - dstart, raw and one_piece, (fstart, fend))

    def _external(self, t: onnx.TensorProto, nbytes: int) -> Stored:
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        rel = PurePosixPath(location.replace("\\", "/"))
        outside = CheckpointError(
            f"{self.path}: initializer {t.name!r} points to external data {location[:80]!r}, which is not a path inside the model's folder"
        )
        if (
            not location
            or "\x00" in location
            or rel.is_absolute()
            or ".." in rel.parts
            or rel.parts[:1]
            and ":" in rel.parts[0]
        ):
            raise outside
        file = self.folder / rel
        try:  # a link that leads out of the folder (but for a Hub cache snapshot's blobs) is refused there
            file_in(self.folder, rel.as_posix())
        except CheckpointError:
            raise
        except (OSError, ValueError):  # a name the file system cannot take (too long, ...)
            raise outside from None
        try:
            offset = int(info.get("offset", 0))
            length = int(info.get("length", nbytes))
        except ValueError:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} has a malformed external data offset or length"
            ) from None
        refuse_self_location(self.path, file, t.name, location)
        if not file.is_file():
            raise CheckpointError(
                f"missing external data file {location} (initializer {t.name!r} of {self.path.name}): "
                f"it must be in {self.folder} as the model says; copy it there or re-export the model"
            )
        if length != nbytes:
            raise CheckpointError(
                f"{self.path}: initializer {t.name!r} has {length} bytes of external data for shape {list(t.dims)}: the model is corrupt"
            )
        size = file.stat().st_size
        if offset < 0 or offset + length > size:
            raise CheckpointError(
                f"external data file {location} is truncated: initializer {t.name!r} needs bytes {offset}-{offset + length} "
                f"but the file has {size}; re-download or re-export the model"
            )
        return Stored(str(rel), offset, length, True)

    # --- WeightSet ----------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        info, stored = self._infos[name], self.stored[name]
        if not stored.in_place:  # varint-encoded (e.g. float16 in int32_data): let onnx decode it
            try:
                array = onnx.numpy_helper.to_array(self.protos[name])
            except ValueError:  # more or fewer values than its shape holds
                raise CheckpointError(
                    f"{self.path}: initializer {name!r} does not hold the values of its shape {list(info.shape)}: "
                    "the model is corrupt"
                ) from None
            return _to_torch(array, info)
        if stored.length == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        buf = bytearray(stored.length)
        with open(self.folder / stored.file, "rb") as f:
            f.seek(stored.offset)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{stored.file} ended while reading initializer {name!r}: the file is truncated")
        return torch.frombuffer(buf, dtype=_dtype(info)).reshape(info.shape)

    def raw(self, name: str) -> bytes:
        stored = self.stored[name]
        if not stored.in_place:
            return super().raw(name)
        with open(self.folder / stored.file, "rb") as f:
            f.seek(stored.offset)
            return f.read(stored.length)

    def record_texts(self) -> list[tuple[str, list[str]]]:
        return [(self.path.name, [p.value for p in self.model.metadata_props if p.key == METADATA_KEY])]

    def describe(self) -> str:
        extra = len(self.files) - 1
        return f"onnx ({self.path.name}" + (
            f" + {extra} external data file{'s' if extra > 1 else ''})" if extra else ")"
        )

    def const(self, name: str) -> np.ndarray | None:
        info = self._infos.get(name)
        if (
            info is None
            or info.nbytes > _SMALL * 8
            or info.torch_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
        ):
            return None
        return self.read(name).numpy()

    def write_plan(self, plan: PlanView, detection: Detection) -> WritePlan:
        """Refuse to change an initializer that nodes outside the plan read too, unless the chosen
        projections can have their own copy of it (see surgeon.formats.onnx_sharing): the copies
        :meth:`save` writes, and the notes saying so."""
        from .onnx_sharing import plan_sharing

        return plan_sharing(self, plan, detection)

    @functools.cached_property
    def names(self) -> set[str]:
        """Every name the graph uses (a copy's name must be none of them)."""
        return graph_names(self.model.graph)

    def all_zero_bytes(self, name: str) -> bool:
        """Every byte of the initializer is 0 (+0.0; -0.0 is not, as zeroing would change its bytes)."""
        info = self._infos.get(name)
        if info is None or info.torch_dtype is None:
            return False
        return not bool(self.read(name).reshape(-1).view(torch.uint8).any())

    def save(self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan) -> None:
        onnx_write.save(self, dest, self.path.name, {f: f for f in self.files[1:]}, updates, record, write_plan, None)

    def save_as(self, dest: Path, name: str, updates: UpdatesFn, record: dict, write_plan: WritePlan) -> list[str]:
        """The model as ``dest/name``, its external data files renamed beside it
        (``wire.renamed_data_files``) and the graph's ``location`` entries rewritten to match."""
        names = wire.renamed_data_files(self.files[1:], self.path.name, name)
        onnx_write.save(self, dest, name, names, updates, record, write_plan, names)
        return [name, *names.values()]

    def files_as(self, name: str) -> list[str]:
        return [name, *wire.renamed_data_files(self.files[1:], self.path.name, name).values()]

    def output_names(self, write_plan: WritePlan) -> list[str]:
        """The initializers, then the copies (appended to the graph's initializers), then the Constant nodes' weights."""
        consts, copies = self.constants, [c.copy for c in write_plan.copies]
        return [n for n in self.tensors if n not in consts] + copies + [n for n in self.tensors if n in consts]

    def check_non_tensor(self, out: WeightSet, changed: set[str], history: list, output: object) -> None:
        """Nothing to add here: the model and graph around the initializers are compared by
        surgeon.audit.graph (it needs the plan's copies of shared initializers), and the record by
        surgeon.report.record."""


def surgeon_records(model: onnx.ModelProto) -> list[dict]:
    """surgeon's records in a model's ``metadata_props`` (oldest first)."""
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            value = loads(p.value, where="surgeon's record in the model's metadata_props")
            return value if isinstance(value, list) else [value]
    return []


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
    if (
        array.dtype.kind in "biuf"
        and array.dtype.name not in ("bfloat16",)
        and array.dtype.itemsize == torch.empty((), dtype=info.torch_dtype).element_size()
    ):
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
