"""What the ONNX writer and the shared-initializer checks read of an opened model (``OnnxWeights`` fills it).

A protocol rather than the class itself, so that ``onnx_write`` and ``onnx_sharing`` do not import
``onnx`` (the format that imports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import onnx

    from .base import TensorInfo
    from .onnx_wire import Layout


@dataclass(frozen=True)
class Stored:
    """Where one initializer's data lives."""

    file: str  # relative to the model's folder: the .onnx itself or an external data file
    offset: int  # absolute byte offset of the data in that file
    length: int
    in_place: bool  # the bytes are the tensor's little-endian values and can be overwritten as they are
    field: tuple[int, int] | None = None  # embedded: the initializer's whole field in the .onnx


class OnnxModel(Protocol):
    """An opened .onnx: its graph as onnx reads it, where each initializer's bytes are, and its files."""

    path: Path  # the .onnx
    folder: Path
    files: list[str]  # the .onnx, then its external data files
    model: onnx.ModelProto  # read without its external data
    layout: Layout  # where the graph's fields are in the .onnx's bytes
    stored: dict[str, Stored]
    protos: dict[str, onnx.TensorProto]  # each initializer's proto (a Constant node's weight as one)

    @property
    def tensors(self) -> dict[str, TensorInfo]: ...

    @property
    def names(self) -> set[str]: ...

    def all_zero_bytes(self, name: str) -> bool: ...
