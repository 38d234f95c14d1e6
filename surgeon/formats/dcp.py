"""torch.distributed.checkpoint (DCP) folders: ``.metadata`` plus one ``.distcp`` file per rank (or more).

Read without running code from the folder (``dcp_metadata``): tensor chunks load with
``torch.load(weights_only=True)`` from byte ranges checked against the files, non-tensor entries (train state,
RNG state, an optimizer's hyper-parameters) are never unpickled. Only the model's tensors are offered to
the rest of surgeon: a full training state keeps them under a wrapper key (``{"model": ..., "optim": ...}``,
as DCP's planner data records), a model-only one (or torchtitan's, which flattens the model to the top)
at the top level; they are named as the model names them, and keep their DCP keys in the output.
Megatron-Core's ``torch_dist`` stacks each layer's tensors along axis 0, one chunk per layer: each layer is
offered as its own tensor (``stacked``), and only the chunks of the layers that change are rewritten. Its
``common.pt`` is read for head counts with weights_only, as data.

The output has the same files, the same ``.metadata`` byte for byte (so the same keys and chunking), and
every byte but the re-initialized chunks' copied: a changed chunk is the ``torch.save`` archive DCP writes
of it, which has the same length for the same shape, strides and dtype, so no offset moves. Each file's
work is separate (:meth:`DcpWeights.chunks_in`): a rank could read and write only its own files.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import CheckpointError, VerificationError
from ..files.folder import file_in
from .base import RankedWeightSet, TensorInfo, UpdatesFn, WeightSet
from .dcp_metadata import METADATA, SUFFIX, Chunk, Layout, TensorEntry, all_spans, read_layout
from .fileio import same_bytes
from .stacked import Slice, stacked_note, unstack
from .torchfile import container_config, safe_load

if TYPE_CHECKING:
    import torch

    from .write_plan import WritePlan

COMMON = "common.pt"  # Megatron's torch_dist: the state that is not sharded (its training arguments, counters)
WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "module")  # where a training state keeps the model


@dataclass(frozen=True)
class NestedDcp:
    """A training framework's checkpoint folder that keeps its DCP checkpoint in a subfolder, beside files
    (train state, the run's config) that surgeon carries over as they are."""

    framework: str
    sub: str  # the DCP checkpoint's subfolder
    marker: str  # a file only this layout has beside it: tells the layout apart from a folder of checkpoints
    config: str  # the framework's own config of the run, beside the subfolder (heads are read from it)


# OLMo-core's Checkpointer (olmo_core/train/checkpoint.py): stepN/{model_and_optim/, train/rankR.pt,
# .metadata.json}, and config.json from its ConfigSaverCallback.
NESTED_DCP = (NestedDcp("OLMo-core", "model_and_optim", "train/rank0.pt", "config.json"),)


def nested_dcp(folder: Path, dcp_folders: list[str]) -> NestedDcp | None:
    """The framework layout ``folder`` is, given the DCP folders found in it, if it is one."""
    for layout in NESTED_DCP:
        if dcp_folders == [layout.sub] and file_in(folder, layout.marker) is not None:
            return layout
    return None


def nested_config(folder: Path) -> Path | None:
    """The run's config beside ``folder`` when ``folder`` is the DCP subfolder of a framework's layout."""
    for layout in NESTED_DCP:
        if folder.name == layout.sub and file_in(folder.parent, layout.marker) is not None:
            return file_in(folder.parent, layout.config)
    return None


def open_dcp(path: str | Path) -> DcpWeights:
    """The DCP checkpoint whose ``.metadata`` is ``path``; a ``.distcp`` file alone is one rank's part of it."""
    path = Path(path)
    if path.name.endswith(SUFFIX):
        raise CheckpointError(
            f"{path} is one data file of a DCP checkpoint (torch.distributed.checkpoint); point surgeon at its "
            f"folder {path.parent}",
            path=path,
        )
    return DcpWeights(path.parent)


def model_keys(layout: Layout, folder: Path) -> tuple[str | None, dict[str, str]]:
    """(the wrapper key the model's tensors sit under, or None; the model's name -> DCP key of each)."""
    tensors = [k for k, e in layout.entries.items() if isinstance(e, TensorEntry)]
    for wrapper in WRAPPER_KEYS:
        keys = [k for k in tensors if len(layout.paths[k]) == 2 and layout.paths[k][0] == wrapper]
        under = {layout.paths[k][1]: k for k in keys}
        if len(under) != len(keys):  # planner data naming two entries alike: which is the model's is unknown
            raise CheckpointError(f"DCP checkpoint {folder}: its planner data gives two tensors one name", path=folder)
        if under and all(isinstance(n, str) for n in under):
            return wrapper, cast(dict[str, str], under)
    top = {k: k for k in tensors if len(layout.paths[k]) == 1}
    if not top:
        keys = sorted({str(p[0]) for p in layout.paths.values()})
        raise CheckpointError(
            f"DCP checkpoint {folder} holds no model tensors: none at its top level nor under "
            f"{'/'.join(WRAPPER_KEYS)} (its top-level keys: {', '.join(keys[:8]) or 'none'})",
            path=folder,
        )
    return None, top


class DcpWeights(RankedWeightSet):
    format = "dcp"
    patches_in_place = False  # chunks are torch.save archives: rewritten whole, each in its own byte range
    rewrites_whole_tensors = True
    graph = False
    record_slot = False  # DCP has no slot loaders ignore: the output folder's model card carries the record
    shard_suffix = SUFFIX

    def __init__(
        self,
        folder: Path,
        files: list[str] | None = None,
        index: str | None = METADATA,
        nested: NestedDcp | None = None,
    ) -> None:
        sub = nested.sub if nested else ""
        layout = read_layout(folder, sub)
        super().__init__(folder, list(layout.files), f"{sub}/{METADATA}" if sub else METADATA)
        self.layout = layout
        self.wrapper, names = model_keys(layout, folder)
        self.keys = names  # model name -> DCP key (of the stored tensor)
        for name, key in names.items():
            entry = cast(TensorEntry, layout.entries[key])
            element = entry.dtype
            itemsize = _itemsize(element)
            first = entry.chunks[0].span.file if entry.chunks else self.files[0]
            self._infos[name] = TensorInfo(name, entry.shape, element, element, first, entry.numel * itemsize)
        # Megatron-Core's torch_dist stacks each layer's tensors along axis 0: offered layer by layer
        self._infos, self.slices = unstack(self._infos, folder, self._file_of)
        carried = len(layout.entries) - len(names)
        where = f"under {self.wrapper!r}" if self.wrapper else "at the top level"
        self.notes = [
            f"DCP checkpoint{f' in {sub}/' if sub else ''}: {len(names)} model tensors {where}; "
            f"{carried} other entr{'y' if carried == 1 else 'ies'} (optimizer, train state) carried over byte for byte, never loaded"
        ]
        if nested:
            self.notes.append(
                f"{nested.framework} checkpoint folder: the model in {sub}/, every file beside it (train state, "
                "config) carried over byte for byte"
            )
        self.notes += stacked_note(self.slices)

    def embedded_config(self) -> dict | None:
        """The head counts in Megatron's ``common.pt`` beside the data files (its training arguments), loaded
        with weights_only (and argparse.Namespace, as Megatron's legacy files): read as data, nothing run.
        One that does not load that way is named in the report and left unread."""
        import zipfile

        path = file_in(self.folder, COMMON)
        if path is None:
            return None
        try:
            obj = safe_load(path, zipfile.is_zipfile(path))
        except CheckpointError as exc:
            self.notes.append(f"{COMMON} not read for head counts: {exc.message}")
            return None
        return container_config(obj)

    embedded_config_file = COMMON

    def describe(self) -> str:
        return f"dcp ({len(self.files)} {SUFFIX} file{'s' if len(self.files) != 1 else ''})"

    def _stored(self, name: str) -> tuple[str, Slice | None]:
        """The model name of the stored tensor ``name`` is (or is a layer of), and which layer."""
        part = self.slices.get(name)
        return (name, None) if part is None else (part.stacked, part)

    def entry(self, name: str) -> TensorEntry:
        """The stored tensor's entry (for a layer of a stacked tensor, the stacked one's)."""
        return cast(TensorEntry, self.layout.entries[self.keys[self._stored(name)[0]]])

    def chunks_of(self, name: str) -> list[Chunk]:
        """The chunks holding ``name``'s values: all of its entry's, or those a stacked layer lies in."""
        part = self._stored(name)[1]
        chunks = self.entry(name).chunks
        if part is None:
            return list(chunks)
        return [c for c in chunks if c.offsets[0] <= part.layer < c.offsets[0] + c.sizes[0]]

    def _file_of(self, stacked: str, layer: int) -> str:
        entry = cast(TensorEntry, self.layout.entries[self.keys[stacked]])
        return next((c.span.file for c in entry.chunks if c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]), "")

    def chunks_in(self, file: str) -> list[tuple[str, Chunk]]:
        """(model name, chunk) of every model chunk stored in ``file``: one rank's share of the work."""
        return [(n, c) for n in self._infos for c in self.chunks_of(n) if c.span.file == file]

    def _load_chunk(self, name: str, chunk: Chunk, folder: Path | None = None) -> torch.Tensor:
        """One chunk, from its torch.save archive (weights_only: no code runs), checked against the metadata."""
        import torch

        span, entry = chunk.span, self.entry(name)
        with open((folder or self.folder) / span.file, "rb") as f:
            f.seek(span.offset)
            data = f.read(span.length)
        where = f"{span.file} (bytes {span.offset}..{span.offset + span.length})"
        if len(data) != span.length:
            raise CheckpointError(f"{self.folder}: {where} ended early: the file is truncated", tensor=name)
        if not data.startswith(b"PK\x03\x04"):
            raise CheckpointError(
                f"{self.folder}: the chunk of {entry.key!r} in {where} is not a torch.save archive; surgeon reads "
                "DCP checkpoints written with the default torch_save serialization",
                tensor=name,
            )
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{self.folder}: the chunk of {entry.key!r} in {where} cannot be loaded safely "
                f"({str(exc).strip().splitlines()[-1][:100]}): surgeon never runs code from a checkpoint",
                tensor=name,
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"{self.folder}: the chunk of {entry.key!r} in {where} is not readable ({type(exc).__name__}); "
                "re-save the checkpoint",
                tensor=name,
            ) from None
        if (
            not isinstance(tensor, torch.Tensor)
            or tuple(tensor.shape) != chunk.sizes
            or tensor.dtype != getattr(torch, entry.dtype)
        ):
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(
                f"{self.folder}: the chunk of {entry.key!r} in {where} holds {got}, the metadata says "
                f"{chunk.sizes} {entry.dtype}: the metadata is not the files' own",
                tensor=name,
            )
        return tensor

    def read(self, name: str) -> torch.Tensor:
        import torch

        entry, part = self.entry(name), self._stored(name)[1]
        if part is None and len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
            return self._load_chunk(name, entry.chunks[0])
        out = torch.empty(entry.shape if part is None else entry.shape[1:], dtype=getattr(torch, entry.dtype))
        for chunk in self.chunks_of(name):
            if part is None:
                out[chunk.slices] = self._load_chunk(name, chunk)
            else:  # the layer's slice of a chunk of the stacked tensor
                out[chunk.slices[1:]] = self._load_chunk(name, chunk)[part.layer - chunk.offsets[0]]
        return out

    def _archive(self, name: str, chunk: Chunk, tensor: torch.Tensor, folder: Path) -> bytes:
        """The chunk as DCP stores it with ``name``'s new value ``tensor`` in it: torch.save of a tensor with the
        stored chunk's strides, which is as long as the stored archive (checked: else offsets would move). The
        chunk is read from ``folder`` (the output being written): other layers of a stacked tensor that share
        it keep the values written there, or their own."""
        import torch

        old = self._load_chunk(name, chunk, folder)
        new = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype)
        part = self._stored(name)[1]
        if part is None:
            new.copy_(tensor[chunk.slices])
        else:
            new.copy_(old)
            new[part.layer - chunk.offsets[0]].copy_(tensor[chunk.slices[1:]])
        buf = io.BytesIO()
        torch.save(new, buf)
        if len(buf.getvalue()) != chunk.span.length:
            raise CheckpointError(
                f"{self.folder}: the chunk of {self.entry(name).key!r} in {chunk.span.file} is stored in "
                f"{chunk.span.length} bytes and this torch writes {len(buf.getvalue())}: it was saved by another "
                "torch version; load and re-save it with dcp.save of this torch, then run surgeon again",
                tensor=name,
            )
        return buf.getvalue()

    def save(
        self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan, files: list[str] | None = None
    ) -> None:
        """``files``: only these ``.distcp`` files, and not ``.metadata`` (one rank's share; see save_shared)."""
        import torch

        # Every file copied as it is, then each changed chunk written over its own byte range: the bytes of
        # every other entry (optimizer state, train state, untouched tensors) are never decoded.
        mine = self.files if files is None else files
        for rel in mine:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.folder / rel, dest / rel)
        if files is None:
            self.save_shared(dest)
            changes: Iterable[tuple[str, torch.Tensor]] = (u for file in self.files for u in updates(file))
            wanted = set(updates.names)
        else:  # a tensor cut into chunks over several ranks' files: each rank computes it, writes its own chunks
            wanted = {n for file in mine for n, _ in self.chunks_in(file)} & updates.names
            changes = updates.only(wanted)
        written = set()
        for name, tensor in changes:
            info = self._infos[name]
            if tuple(tensor.shape) != info.shape or tensor.dtype != getattr(torch, info.element or ""):
                raise AssertionError(f"update of {name} changes its shape or dtype")
            for chunk in self.chunks_of(name):  # a sharded tensor's chunks may lie in other ranks' files
                if chunk.span.file not in mine:
                    continue
                with open(dest / chunk.span.file, "r+b") as out:
                    os.pwrite(out.fileno(), self._archive(name, chunk, tensor, dest), chunk.span.offset)
            written.add(name)
        missing = wanted - written
        if missing:  # a planned tensor that was not computed would keep its old value: never write that
            raise AssertionError(f"no new value for {sorted(missing)[:3]}")

    def check_non_tensor(self, out: WeightSet, changed: set[str], history: list, output: object) -> None:
        """The same ``.metadata`` byte for byte; every byte of every file outside the changed chunks as it
        was; each changed chunk exactly the torch.save archive of its tensor (nothing else in it)."""
        import torch

        out = cast(DcpWeights, out)  # verify compares sets of the same format only
        assert self.index is not None and out.index == self.index
        if not same_bytes(self.folder / self.index, out.folder / out.index):
            raise VerificationError(f"{output}: its {self.index} differs from the original's; surgeon carries it over")
        spans: dict[str, list[tuple[int, int]]] = {rel: [] for rel in self.files}
        for name in sorted(changed):
            for chunk in self.chunks_of(name):
                if (chunk.span.offset, chunk.span.offset + chunk.span.length) in spans[chunk.span.file]:
                    continue  # a chunk holding two changed layers of a stacked tensor
                spans[chunk.span.file].append((chunk.span.offset, chunk.span.offset + chunk.span.length))
                stored = out._load_chunk(name, chunk)
                buf = io.BytesIO()
                torch.save(stored, buf)
                with open(out.folder / chunk.span.file, "rb") as f:
                    f.seek(chunk.span.offset)
                    if f.read(chunk.span.length) != buf.getvalue():
                        raise VerificationError(
                            f"{output}: the chunk of {self.entry(name).key!r} in {chunk.span.file} is not the archive "
                            "torch.save writes of its tensor"
                        )
        for rel, ranges in spans.items():
            if not _same_outside(self.folder / rel, out.folder / rel, sorted(ranges)):
                raise VerificationError(
                    f"{output}: {rel} differs from the original's outside the re-initialized chunks "
                    "(optimizer state, train state and untouched tensors are carried over byte for byte)"
                )

    def other_entries(self) -> list[str]:
        """The DCP keys surgeon carries over without reading: everything but the model's tensors."""
        model = set(self.keys.values())
        return [k for k, _ in all_spans(self.layout) if k not in model]


def _itemsize(element: str) -> int:
    import torch

    return getattr(torch, element).itemsize


def _same_outside(a: Path, b: Path, ranges: list[tuple[int, int]], block: int = 1 << 20) -> bool:
    """Files ``a`` and ``b`` have the same size and the same bytes outside ``ranges`` (sorted, disjoint)."""
    size = a.stat().st_size
    if b.stat().st_size != size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        pos = 0
        for begin, end in ranges + [(size, size)]:
            while pos < begin:
                n = min(block, begin - pos)
                if os.pread(fa.fileno(), n, pos) != os.pread(fb.fileno(), n, pos):
                    return False
                pos += n
            pos = max(pos, end)
    return True
