"""What every weight format offers: tensor infos, reading one tensor, writing a patched copy."""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import CheckpointError
from ..files.bounded import INDEX_LIMIT, read_json
from ..files.folder import file_in
from ..vocab.change import PlanView
from .byte_source import ByteSource, LocalFiles
from .write_plan import WritePlan

if TYPE_CHECKING:
    import torch

    from ..vocab.detection import Detection

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the format's own name for the dtype, e.g. "BF16" or "bfloat16"
    element: str | None  # the torch dtype's name ("bfloat16"); None where torch has no equivalent
    file: str  # the file (shard) holding it, relative to the weight set's folder
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.element in FLOAT_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch  # here, not at import: opening and planning do not need torch

        return getattr(torch, self.element, None) if self.element else None


class UpdatesFn(Protocol):
    """The new values of the tensors that change, one at a time.

    ``names``: every tensor that will change (in any file), known before anything is computed, so a
    format can copy everything else in the background. ``updates(file)`` yields ``(name, tensor)`` for
    the tensors of ``file`` that change (each with its original shape and dtype), computing each as it is
    asked for: a format that writes each value away before asking for the next holds one at a time.
    """

    names: frozenset[str]

    def __call__(self, file: str) -> Iterator[tuple[str, torch.Tensor]]: ...

    def only(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The new values of those of ``names`` that change, wherever they are stored (one rank's share)."""
        ...


class WeightSet(ABC):
    """The weight files of one checkpoint: a single file, or shards plus their index file."""

    format: str  # "safetensors", "torch", "onnx"
    shard_suffix: str = ""  # what every shard named by an index file must end with
    # What the format can do, asked by the rest of surgeon instead of the format's name:
    patches_in_place: bool = False  # --in-place rewrites byte ranges (journaled) instead of replacing files
    rewrites_whole_tensors: bool = True  # can rewrite any tensor (a mode's extra ones, W_O), not only Q/K/V
    graph: bool = False  # attention is found by walking the model's graph, not by tensor names
    record_slot: bool = False  # the files carry surgeon's record themselves (else a folder's model card does)
    # every format declares each of these in its own class, even where the default fits (tests/open/test_format_interface.py)
    CAPABILITIES = ("patches_in_place", "rewrites_whole_tensors", "graph", "record_slot")

    def __init__(self, folder: Path, files: list[str], index: str | None) -> None:
        self.folder = folder
        self.files = files  # weight files (shards), relative to folder, in index order
        self.index = index  # the index file (model.safetensors.index.json), if sharded
        self._infos: dict[str, TensorInfo] = {}
        self.notes: list[str] = []  # for the report: how the set was read (a DCP state's model entries)
        self.bytes: ByteSource = LocalFiles(folder)  # a Hub model's safetensors: surgeon.hub.remote.HubFiles

    @classmethod
    def from_index(cls, index_path: Path) -> WeightSet:
        """The shards an index file names, in the order of their names."""
        weight_map = read_index(index_path, cls.shard_suffix)
        shards = shard_order(weight_map)
        for shard in shards:  # before any is opened: a link out of the folder or a FIFO is refused (folder_files)
            file_in(index_path.parent, shard)
        return cls(index_path.parent, shards, index_path.name)

    def _check_index(self, found: dict[str, str]) -> None:
        if self.index is not None:
            check_index_against_shards(
                self.folder / self.index, read_index(self.folder / self.index, self.shard_suffix), found
            )

    @property
    def all_files(self) -> list[str]:
        return self.files + ([self.index] if self.index else [])

    @property
    def local_files(self) -> list[str]:
        """The files of ``all_files`` that are on disk (a Hub model read by Range has only some there)."""
        return [f for f in self.all_files if self.bytes.on_disk(f)]

    def local_path(self, file: str) -> Path:
        """One of ``all_files`` on disk, for a writer that copies it whole (fetched first where it is remote)."""
        return self.bytes.local(file)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, in file order."""
        return self._infos

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """One tensor, decoded on the CPU in its stored dtype."""

    @abstractmethod
    def save(self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan) -> None:
        """Write every file of this set into the folder ``dest`` under the same relative names.

        Tensors that are not updated keep their bytes; ``record`` says what surgeon did and goes
        into the file's metadata where the format has a place for it; ``write_plan``: what
        :meth:`write_plan` decided for the plan ``updates`` carries out.
        """

    def save_as(self, dest: Path, name: str, updates: UpdatesFn, record: dict, write_plan: WritePlan) -> list[str]:
        """Write this set into the folder ``dest`` as the single file ``name`` and the files that go
        with it (an .onnx and its external data); returns the names written. Formats whose files
        cannot be renamed do not have it."""
        raise NotImplementedError(f"{self.format} weights cannot be written under another name")

    def files_as(self, name: str) -> list[str]:
        """The names :meth:`save_as` would write for ``name``: the file itself, then the files beside it."""
        raise NotImplementedError(f"{self.format} weights cannot be written under another name")

    def write_plan(self, plan: PlanView, detection: Detection) -> WritePlan:
        """What this format decides about writing ``plan`` (made from ``detection``), handed to the saves
        and to verify: notes for the report and, for a graph, the copies of shared initializers. Refuses
        a plan the format cannot carry out safely (e.g. an ONNX initializer shared with nodes outside the
        plan) with a SurgeonError."""
        return WritePlan()  # most formats can carry out any plan as it is

    @abstractmethod
    def check_non_tensor(self, out: WeightSet, changed: set[str], history: list, output: object) -> None:
        """``surgeon verify``: everything but the tensors of ``out``, surgeon's output of this set, is as
        surgeon writes it; raise a VerificationError naming ``output`` at the first difference.

        ``changed``: the tensors the verified plan changes; ``history``: the surgeon records ``out`` must
        carry (the original's and the verified run's). The tensors themselves are checked by surgeon.audit."""

    def output_names(self, write_plan: WritePlan) -> list[str]:
        """The tensors surgeon's output of this set holds, in order, written by ``write_plan`` (a graph's
        adds the copies of shared initializers its chosen projections read)."""
        return list(self.tensors) + [c.copy for c in write_plan.copies]

    def embedded_config(self) -> dict | None:
        """Model arguments the weight file itself carries (a training checkpoint's), if any."""
        return None

    @property
    def embedded_config_file(self) -> str:
        """The file :meth:`embedded_config` reads, for the report."""
        return self.files[0]

    def raw(self, name: str) -> bytes:
        """A tensor's stored bytes (formats that can, read them by byte range without decoding)."""
        return tensor_bytes(self.read(name))

    def record_texts(self) -> list[tuple[str, list[str]]]:
        """surgeon's record entries as stored, per file: (file, the texts under surgeon's key); [] without a slot."""
        return []

    def nbytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in self.all_files)

    def describe(self) -> str:
        shards = f"{len(self.files)} shards" if len(self.files) > 1 else self.files[0]
        return f"{self.format} ({shards})"


class RankedWeightSet(WeightSet):
    """A format whose data files several ranks write apart (DCP, sharded safetensors): each rank saves its
    own ``files``, and one rank then adds the files they have in common (:meth:`save_shared`)."""

    @abstractmethod
    def save(
        self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan, files: list[str] | None = None
    ) -> None:
        """:meth:`WeightSet.save`; with ``files``, only these data files and none of the shared ones."""

    def save_shared(self, dest: Path) -> None:
        """The files every rank's share has in common (the index, DCP's ``.metadata``), copied as they are."""
        if self.index:
            shutil.copyfile(self.folder / self.index, dest / self.index)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The little-endian bytes of a tensor, as safetensors stores them."""
    import torch

    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def read_index(path: Path, suffix: str) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index file, validated."""
    index = read_json(path, what="index", limit=INDEX_LIMIT)
    try:
        weight_map = index["weight_map"]
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read index {path}: {exc}; expected JSON with a 'weight_map'") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"index {path} has an empty or malformed 'weight_map'")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(suffix):
            raise CheckpointError(f"index {path} maps {name!r} to {shard!r}, which is not a {suffix} file")
        # Shards sit beside their index. A name with a folder in it ("../x", "/abs/x") would make
        # surgeon read, and write, files outside the checkpoint: refuse it.
        if "/" in shard or "\\" in shard:
            raise CheckpointError(
                f"index {path} maps {name!r} to {shard!r}, which is not a file beside the index; "
                "shard names must be plain file names"
            )
    return weight_map


def shard_order(weight_map: dict[str, str]) -> list[str]:
    return sorted(set(weight_map.values()))


def check_index_against_shards(index: Path, weight_map: dict[str, str], found: dict[str, str]) -> None:
    """Every tensor the index names must be in the shard it names (``found``: name -> shard)."""
    for name, shard in weight_map.items():
        if found.get(name) != shard:
            where = f"it is in {found[name]}" if name in found else "no shard has it"
            raise CheckpointError(
                f"index {index.name} says tensor {name!r} is in {shard}, but {where}: "
                "the index and shards do not match; re-download or re-save the checkpoint"
            )
