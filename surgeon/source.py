"""Open what the user points at: a weight file, a sharded index, or a model folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointError
from .formats.base import WeightSet
from .formats.safetensors import INDEX_SUFFIX as ST_INDEX
from .formats.safetensors import SafetensorsWeights
from .formats.torchfile import INDEX_SUFFIX as PT_INDEX
from .formats.torchfile import SUFFIXES as PT_SUFFIXES
from .formats.torchfile import TorchWeights

# Files a training run leaves in a model folder that are pickles but not weights.
NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt"}
SKIP_DIRS = {".git", ".cache"}
# Copies of the weights in formats surgeon does not rewrite here. Carried over unchanged they would
# still hold the old attention weights, so a folder output leaves them out and says so.
STALE_WEIGHT_SUFFIXES = (".h5", ".msgpack", ".ot", ".gguf", ".tflite", ".mlmodel", ".onnx", ".onnx_data", ".onnx.data")
STALE_WEIGHT_DIRS = {"onnx", "openvino", "coreml", "tflite", "gguf"}
TORCH_NAMES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth", "model.ckpt")


@dataclass
class Source:
    path: Path  # what the user gave
    kind: str  # "file", "index" or "folder"
    weights: list[WeightSet]  # the primary set first; a folder may hold the same weights twice
    config: dict | None = None
    config_path: Path | None = None
    extra_files: list[str] = field(default_factory=list)  # folder inputs: carried over unchanged
    hub_id: str | None = None
    hub_revision: str | None = None  # as asked for (branch, tag or commit); None: the default branch
    hub_commit: str | None = None  # the commit the files came from
    notes: list[str] = field(default_factory=list)  # for the report: where MODEL was read from

    @property
    def primary(self) -> WeightSet:
        return self.weights[0]

    @property
    def folder(self) -> Path:
        return self.primary.folder

    @property
    def format(self) -> str:
        return self.primary.format

    def describe(self) -> str:
        return self.primary.describe()


def open_source(path: str | Path, *, config: str | Path | None = None) -> Source:
    path = Path(path)
    recovered = _recover(path)
    if path.is_dir():
        source = _open_folder(path)
    elif path.is_file():
        source = _open_file(path)
    else:
        raise CheckpointError(f"no such file or folder: {path}")
    if config is not None:
        source.config_path = Path(config)
    elif source.config_path is None and (source.folder / "config.json").is_file():
        source.config_path = source.folder / "config.json"
    if source.config_path is not None:
        source.config = read_config(source.config_path)
    source.notes[:0] = recovered
    return source


def _recover(path: Path) -> list[str]:
    """Roll back an in-place run on this checkpoint that was interrupted (see surgeon.journal)."""
    from .journal import SUFFIX, recover

    folder = path if path.is_dir() else path.parent
    if not any(folder.glob(f".*{SUFFIX}*")):
        return []
    return recover(path)


def read_config(path: Path) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no such config file: {path}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"config {path} is not a JSON object")
    return config


def _other_weights(rel: Path) -> bool:
    """A top-level weight file outside the chosen set (e.g. Mistral's consolidated.safetensors)."""
    if len(rel.parts) > 1 or rel.name in NOT_WEIGHTS or rel.name.startswith(("rng_state", "optimizer", "scheduler")):
        return False
    return rel.name.endswith((".safetensors", ".safetensors.index.json", ".bin.index.json")) or rel.suffix in PT_SUFFIXES


def _open_file(path: Path) -> Source:
    name = path.name
    if name.endswith(ST_INDEX):
        return Source(path, "index", [SafetensorsWeights.from_index(path)])
    if name.endswith(PT_INDEX):
        return Source(path, "index", [TorchWeights.from_index(path)])
    if path.suffix == ".safetensors":
        return Source(path, "file", [SafetensorsWeights(path.parent, [name])])
    if path.suffix in PT_SUFFIXES:
        return Source(path, "file", [TorchWeights(path.parent, [name])])
    if path.suffix == ".onnx":
        from .formats.onnx import open_onnx  # optional module, built on the core

        weights = open_onnx(path)
        # With external data the .onnx is like an index over its data files: the output is a folder.
        return Source(path, "index" if len(weights.files) > 1 else "file", [weights])
    raise CheckpointError(
        f"{path}: unknown checkpoint type {path.suffix or '(no suffix)'}; surgeon reads .safetensors, "
        ".bin/.pt/.pth/.ckpt, their .index.json, .onnx files and model folders"
    )


def _open_folder(folder: Path) -> Source:
    sets: list[WeightSet] = []
    top = sorted(p.name for p in folder.iterdir() if p.is_file())
    st_index = [n for n in top if n.endswith(ST_INDEX)]
    if st_index:
        sets.append(SafetensorsWeights.from_index(folder / st_index[0]))
    elif any(n.endswith(".safetensors") for n in top):
        sets.append(SafetensorsWeights(folder, [n for n in top if n.endswith(".safetensors")]))
    pt_index = [n for n in top if n.endswith(PT_INDEX)]
    if pt_index:
        sets.append(TorchWeights.from_index(folder / pt_index[0]))
    else:
        named = [n for n in TORCH_NAMES if n in top]
        others = [n for n in top if Path(n).suffix in PT_SUFFIXES and n not in NOT_WEIGHTS and not n.startswith(("rng_state", "optimizer"))]
        picked = named[:1] or (others if len(others) == 1 else [])
        if picked:
            sets.append(TorchWeights(folder, picked))
    if not sets:
        onnx_files = [n for n in top if n.endswith(".onnx")]
        if len(onnx_files) > 1:
            raise CheckpointError(
                f"folder {folder} holds {len(onnx_files)} ONNX models ({', '.join(onnx_files[:3])}{', ...' if len(onnx_files) > 3 else ''}); "
                "point surgeon at one .onnx file"
            )
        if onnx_files:
            from .formats.onnx import open_onnx

            sets.append(open_onnx(folder / onnx_files[0]))
    if not sets:
        raise CheckpointError(
            f"no weights in folder {folder}: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin(.index.json) or a .onnx file"
        )
    weight_files = {f for s in sets for f in s.all_files}
    extras, stale = [], []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if rel.parts[0] in SKIP_DIRS or not p.is_file() or str(rel) in weight_files:
            continue
        if rel.parts[0].endswith((".surgeon-tmp", ".surgeon-old", ".surgeon-journal", ".surgeon-journal.tmp")):  # a run's leftovers
            continue
        if (
            (len(rel.parts) > 1 and rel.parts[0] in STALE_WEIGHT_DIRS)
            or p.name.endswith(STALE_WEIGHT_SUFFIXES)
            or _other_weights(rel)
        ):
            stale.append(rel.parts[0] + "/" if len(rel.parts) > 1 else str(rel))
            continue
        extras.append(str(rel))
    notes = []
    if stale:
        names = ", ".join(dict.fromkeys(stale))
        notes.append(f"left out other copies of the weights that surgeon does not rewrite here: {names} (re-export them from the output)")
    return Source(folder, "folder", sets, extra_files=extras, notes=notes)
