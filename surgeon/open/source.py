"""Open what the user points at: a weight file, a sharded index, or a model folder."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import NoReturn

from ..errors import CheckpointError
from ..files.bounded import read_json, read_yaml, refuse_special
from ..files.folder import file_in, walk
from ..formats.base import WeightSet
from ..formats.byte_source import Transfer
from ..formats.registry import (
    ALONE_SUFFIXES,
    EXPORT_DIRS,
    FORMATS,
    NOT_WEIGHTS,
    OTHER_FORMAT_SUFFIXES,
    STATE_DICT_SUFFIXES,
    WEIGHT_SUFFIXES,
    format_of,
    pick_dcp,
)
from ..formats.stacked import check_layer_count
from ..vocab.config_keys import FRAMEWORK_CONFIGS, FrameworkConfig, framework_config

SKIP_DIRS = {".git", ".cache"}
OPEN_CLIP_CONFIG = "open_clip_config.json"
# Copies of the weights in formats surgeon does not rewrite here. Carried over unchanged they would
# still hold the old attention weights, so a folder output leaves them out and says so.
STALE_WEIGHT_SUFFIXES = OTHER_FORMAT_SUFFIXES + ALONE_SUFFIXES
# sharded/: the per-rank shards torch's HuggingFaceStorageWriter keeps beside the consolidated safetensors it
# writes from them (torchtitan's last_save_in_hf): the same weights again.
STALE_WEIGHT_DIRS = EXPORT_DIRS | {"sharded"}


@dataclass(frozen=True)
class Source:
    """What was opened: a value, made once (``open_source`` and ``open_model`` make a new one per step)."""

    path: Path  # what the user gave
    kind: str  # "file", "index" or "folder"
    weights: tuple[WeightSet, ...]  # the primary set first; a folder may hold the same weights twice
    config: dict | None = None
    config_path: Path | None = None
    extra_files: tuple[str, ...] = ()  # folder inputs: carried over unchanged
    hub_id: str | None = None
    hub_revision: str | None = None  # as asked for (branch, tag or commit); None: the default branch
    hub_commit: str | None = None  # the commit the files came from
    notes: tuple[str, ...] = ()  # for the report: where MODEL was read from

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

    @property
    def transfer(self) -> Transfer | None:
        """What reading the weights moved over the network so far (None: they are on disk)."""
        return self.primary.bytes.transfer


def open_source(
    path: str | Path, *, config: str | Path | None = None, recover: bool = False, weights: WeightSet | None = None
) -> Source:
    """Open the checkpoint at ``path``. A checkpoint an in-place run left half-patched (its journal is
    there) is refused, unless ``recover``: then the journal is checked and rolled back first (an
    in-place run on the same checkpoint does that; nothing else writes to an input).

    ``weights``: the folder's weights, opened already (a Hub model's read by Range, whose shards are not
    in the folder); the folder gives the rest."""
    from .recovery import recover as roll_back
    from .recovery import refuse_journals

    path = Path(path)
    refuse_special(path, what="model")
    if not path.is_dir() and not path.is_file():
        raise CheckpointError(f"no such file or folder: {path}")
    recovered = roll_back(path, own=True) if recover else []
    refuse_journals(path)
    opened = _open_folder(path, weights) if path.is_dir() else _open_file(path)
    found: list[str] = []  # where the config came from
    config_path = opened.config_path
    if config is not None:  # given by the user: theirs to choose, wherever it is
        config_path = Path(config)
    elif config_path is None:  # found beside the weights: only the folder's own (folder_files)
        config_path = _config_beside(opened)
        if config_path is None and opened.format == "dcp":  # a framework's DCP subfolder: its run's config
            from ..formats.dcp import nested_config

            config_path = nested_config(opened.folder)
            if config_path is not None:
                found.append(f"head counts from the run's config beside the checkpoint, {config_path}")
    config_read = opened.config
    if config_path is not None:
        config_read = read_config(config_path)
        if _framework(config_path) is not None:
            where = "beside the weights" if config is None else "given as the config"
            found.append(f"head counts from {config_path.name} {where}")
    elif (embedded := opened.primary.embedded_config()) is not None:
        config_read = embedded
        found.append(f"head counts from the model arguments saved in {opened.primary.embedded_config_file}")
    notes = (*recovered, *opened.notes, *found, *(note for w in opened.weights for note in w.notes))
    source = replace(opened, config=config_read, config_path=config_path, notes=notes)
    for weights in source.weights:  # stacked layers: as many as the config says the model has
        check_layer_count(getattr(weights, "slices", {}), layer_counts(source.config), source.path)
    return source


LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")


def layer_counts(config: dict | None) -> dict[str, int]:
    """The layer counts a config gives (config.json's, or Megatron's arguments), by field."""
    return {k: v for k in LAYER_COUNT_KEYS if isinstance(v := (config or {}).get(k), int) and not isinstance(v, bool)}


def _config_beside(source: Source) -> Path | None:
    """The config file beside the weights: config.json (or open_clip's), else a framework's own
    (FRAMEWORK_CONFIGS: litgpt's model_config.yaml), which wins over config.json for the framework's own
    weight file (lit_model.pth: a litgpt download keeps Hugging Face's config.json beside it)."""
    folder = source.folder
    frameworks = [(f, path) for f in FRAMEWORK_CONFIGS if (path := file_in(folder, f.file)) is not None]
    own = [path for f, path in frameworks if source.primary.files == [f.weights]]
    found = own + [file_in(folder, "config.json"), file_in(folder, OPEN_CLIP_CONFIG)] + [p for _, p in frameworks]
    return next((p for p in found if p is not None), None)


def _framework(path: Path) -> FrameworkConfig | None:
    return next((f for f in FRAMEWORK_CONFIGS if path.name == f.file), None)


def read_config(path: Path) -> dict:
    """config.json, or a framework's own config file (by its name) in config.json's terms."""
    framework = _framework(path)
    if framework is not None:
        data = read_yaml(path, what="config")
        if not isinstance(data, dict):
            raise CheckpointError(f"config {path} is not a YAML mapping of fields ({framework.model_type}'s config)")
        return framework_config(framework, data)
    config = read_json(path, what="config")
    if not isinstance(config, dict):
        raise CheckpointError(f"config {path} is not a JSON object")
    return config


def _other_weights(rel: PurePosixPath) -> bool:
    """A top-level weight file outside the chosen set (e.g. Mistral's consolidated.safetensors)."""
    if len(rel.parts) > 1 or rel.name in NOT_WEIGHTS or rel.name.startswith(("rng_state", "optimizer", "scheduler")):
        return False
    return rel.name.endswith(STATE_DICT_SUFFIXES)


def _open_file(path: Path) -> Source:
    fmt = format_of(path.name)
    if fmt is None:
        raise CheckpointError(
            f"{path}: unknown checkpoint type {path.suffix or '(no suffix)'}; surgeon reads .safetensors, "
            ".bin/.pt/.pth/.ckpt, their .index.json, .onnx files and model folders",
            path=path,
        )
    weights = fmt.open(path.parent, [path.name])
    # An index file, or an .onnx with external data (like an index over its data files): the output is a folder.
    return Source(path, "index" if fmt.is_index(path.name) or len(weights.files) > 1 else "file", (weights,))


def _split_variants(picked: list[str]) -> list[list[str]]:
    """The full weights, then each variant file (``NAME.VARIANT.SUFFIX`` beside ``NAME.SUFFIX``, as
    diffusers saves its fp16 variant) as a set of its own: the same tensors, rewritten alike."""
    names = set(picked)
    variants = []
    for name in picked:
        stem, dot, suffix = name.rpartition(".")
        base, _, variant = stem.rpartition(".")
        if dot and base and variant and f"{base}.{suffix}" in names:
            variants.append(name)
    rest = [n for n in picked if n not in variants]
    return [rest] + [[v] for v in variants] if rest else [picked]


def _variant_indexes(folder: Path, top: list[str], sets: list[WeightSet]) -> list[WeightSet]:
    """Sharded variants beside sharded weights (diffusers: NAME.safetensors.index.fp16.json over
    NAME.fp16-0000K-of-0000N.safetensors), each a set of its own."""
    out = []
    for name in top:
        match = re.match(r"^(.+)\.index\.[A-Za-z0-9_]+\.json$", name)
        fmt = format_of(match.group(1)) if match else None
        if match and fmt is not None and any(s.index == f"{match.group(1)}.index.json" for s in sets):
            out.append(fmt.weight_set().from_index(folder / name))
    return out


def _open_folder(folder: Path, weights: WeightSet | None = None) -> Source:
    # A folder without weights is said to be one, whatever links lie in it (a project folder's .venv): a look
    # at the names, nothing opened. Then one walk, before any file is opened: a link out of the folder is refused
    # here, FIFOs and linked folders are left out, so nothing from outside reaches the weights, card or output.
    # ``weights``: read where they are (a Hub model's shards by Range), not from the folder.
    if weights is None:
        seen = walk(folder, prune=_not_read, names_only=True).files
        if not any(fmt.pick([f for f in seen if "/" not in f]) for fmt in FORMATS) and not _dcp_folders(seen):
            _refuse_no_weights(folder, seen)
    found = walk(folder, prune=_not_read)
    top = [f for f in found.files if "/" not in f]
    sets = [weights] if weights is not None else _weight_sets(folder, top) or _nested_dcp(folder, found.files)
    if not sets:
        _refuse_no_weights(folder, found.files)
    extras, stale = _other_files(found.files, {f for s in sets for f in s.all_files})
    stale = sorted(stale + [f"{d}/" for d in STALE_WEIGHT_DIRS if _holds_anything(folder / d)])
    notes = []
    if stale:
        names = ", ".join(dict.fromkeys(stale))
        notes.append(
            f"left out other copies of the weights that surgeon does not rewrite here: {names} (re-export them from the output)"
        )
    return Source(folder, "folder", tuple(sets), extra_files=tuple(extras), notes=(*notes, *found.note()))


_LEFTOVERS = (".surgeon-tmp", ".surgeon-old", ".surgeon-journal", ".surgeon-journal.tmp")  # a run's


def _not_read(rel: PurePosixPath, is_folder: bool) -> bool:
    """What a folder's walk skips: bookkeeping, a run's leftovers, and export folders of the old weights."""
    top = rel.parts[0]
    return top in SKIP_DIRS or top.endswith(_LEFTOVERS) or (is_folder and str(rel) in STALE_WEIGHT_DIRS)


def _holds_anything(path: Path) -> bool:
    if not path.is_dir():
        return False
    with os.scandir(path) as entries:
        return any(True for _ in entries)


def _weight_sets(folder: Path, top: list[str]) -> list[WeightSet]:
    """The weight sets among the folder's top-level files ``top``, in the formats' order of preference."""
    sets: list[WeightSet] = []
    for fmt in FORMATS:  # the same weights may be there twice (safetensors and .bin): the preferred first
        if fmt.alone and sets:
            continue
        picked = fmt.pick(top)
        if not picked:
            continue
        if fmt.alone and sum(n.endswith(fmt.suffixes) for n in top) > 1:
            many = [n for n in top if n.endswith(fmt.suffixes)]
            raise CheckpointError(
                f"folder {folder} holds {len(many)} {fmt.name.upper() if fmt.name == 'onnx' else fmt.name} models "
                f"({', '.join(many[:3])}{', ...' if len(many) > 3 else ''}); point surgeon at one {fmt.suffixes[0]} file",
                path=folder,
            )
        if fmt.alone:
            sets.append(fmt.open(folder, picked[:1]))
            continue
        for files in _split_variants(picked):  # diffusers' x.fp16.safetensors beside x.safetensors: each its own set
            sets.append(fmt.open(folder, files))
    return sets + _variant_indexes(folder, top, sets)


def _dcp_folders(files: list[str]) -> list[str]:
    """The folders among ``files`` (relative paths) that hold a DCP checkpoint: a .metadata and .distcp files
    (torchtitan's step-N/, OLMo-core's stepN/model_and_optim/, Megatron's iter_N/)."""
    parents: dict[str, set[str]] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        if parent:
            parents.setdefault(parent, set()).add(name)
    return sorted(p for p, names in parents.items() if pick_dcp(sorted(names)))


def _nested_dcp(folder: Path, files: list[str]) -> list[WeightSet]:
    """The DCP checkpoint in a training framework's checkpoint folder (OLMo-core's stepN/model_and_optim/)."""
    from ..formats.dcp import DcpWeights, nested_dcp

    layout = nested_dcp(folder, _dcp_folders(files))
    return [DcpWeights(folder, nested=layout)] if layout else []


def _refuse_no_weights(folder: Path, files: list[str]) -> NoReturn:
    """A folder without weights: say where they are if it is a diffusers pipeline or holds DCP checkpoints,
    else what was expected."""
    dcp = _dcp_folders(files)
    if dcp:
        more = f" (and {len(dcp) - 3} more)" if len(dcp) > 3 else ""
        raise CheckpointError(
            f"{folder} holds no weights itself but {'a DCP checkpoint' if len(dcp) == 1 else 'DCP checkpoints'} "
            f"(torch.distributed.checkpoint) in {', '.join(str(folder / d) for d in dcp[:3])}{more}: "
            "point surgeon at that folder",
            path=folder,
        )
    if (folder / "model_index.json").is_file():
        parts = sorted(
            p.name
            for p in folder.iterdir()
            if p.is_dir() and any(f.name.endswith(WEIGHT_SUFFIXES) for f in p.iterdir())
        )
        raise CheckpointError(
            f"{folder} is a diffusers pipeline (model_index.json): point surgeon at one of its components "
            f"({', '.join(f'{folder / p}' for p in parts) or 'none holds weights'})",
            path=folder,
        )
    raise CheckpointError(
        f"no weights in folder {folder}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin(.index.json), a .onnx file or a DCP checkpoint (.metadata and .distcp files)",
        path=folder,
    )


def _other_files(files: list[str], weight_files: set[str]) -> tuple[list[str], list[str]]:
    """The folder's files (``files``, already walked) besides the weights: (those copied to the output,
    stale weight copies left out)."""
    extras, stale = [], []
    for name in files:
        rel = PurePosixPath(name)
        if name in weight_files:
            continue
        if rel.name.endswith(STALE_WEIGHT_SUFFIXES) or _other_weights(rel):
            stale.append(rel.parts[0] + "/" if len(rel.parts) > 1 else name)
            continue
        extras.append(name)
    return extras, stale


def folder_output_files(source: Source) -> tuple[list[str], list[str]]:
    """What a folder output of ``source`` holds besides its model card: (the weight files surgeon rewrites,
    the files it carries over byte for byte: index files and, from a folder, its other files)."""
    weights = [f for w in source.weights for f in w.files]
    indexes = [w.index for w in source.weights if w.index]
    carried = list(source.extra_files) if source.kind == "folder" else []
    return sorted(set(weights)), sorted(set(indexes + carried))
