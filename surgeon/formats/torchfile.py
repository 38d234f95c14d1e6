"""PyTorch state dicts (``.bin``, ``.pt``, ``.pth``, ``.ckpt``), single or sharded.

Loaded only with ``torch.load(weights_only=True)``: surgeon never runs code from a file. Zip-format
files are memory-mapped, so tensors are paged in on use, not held in memory. A top-level
``state_dict`` / ``model`` entry is unwrapped, and written back in place with everything around it
kept. Untouched tensors are saved from the same storages, so their bytes are unchanged. A model kept as
nested dicts of tensors (Megatron-LM's legacy ``{"model": {"language_model": {"encoder": ...}}}``) is read under
dotted names and written back in its nesting; Megatron-Core's stacked-layer tensors layer by layer (``stacked``).
"""

from __future__ import annotations

import copy
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .write_plan import WritePlan

from ..errors import CheckpointError, VerificationError
from .base import TensorInfo, UpdatesFn, WeightSet
from .fileio import same_bytes
from .stacked import stacked_note, unstack
from .suffixes import TORCH_SUFFIXES

INDEX_SUFFIX = ".bin.index.json"
WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")
CONFIG_KEYS = ("model_args", "hyper_parameters", "config")  # nanoGPT ckpt.pt, PyTorch Lightning, from-scratch loops
MEGATRON_CHECKPOINT_VERSION = "checkpoint_version"
MEGATRON_ARGS = "args"  # Megatron-LM's legacy model_optim_rng.pt: its argparse.Namespace of training arguments
# The only class a pickle may ask for beyond weights_only's own: Megatron's argparse.Namespace, which unpickles
# to attributes (no code runs); everything inside it is still held to weights_only's rules.
SAFE_EXTRA_GLOBALS = ("argparse.Namespace",)


def _is_state_dict(obj: object) -> bool:
    import torch

    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(k, str) for k in obj)
        and any(isinstance(v, torch.Tensor) for v in obj.values())
    )


def load_file(path: Path) -> tuple[object, str | None, Mapping]:
    """Load a file safely: (the whole object, the wrapper key or None, the state dict; a nested one flattened)."""
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    is_zip = zipfile.is_zipfile(path)
    if not is_zip:
        with open(path, "rb") as f:
            head = f.read(8)
        # torch.save writes a zip archive, or (legacy) a pickle, which starts with the PROTO opcode 0x80
        if head[:1] != b"\x80" and head[:2] != b"PK":  # PK: a zip archive, perhaps cut short
            raise CheckpointError(
                f"{path} is not a PyTorch checkpoint: it is neither a zip archive nor a pickle (it starts with "
                f"{head!r}); surgeon reads torch.save files, safetensors and ONNX (a CTranslate2, GGUF or TF file is none of them)"
            )
    obj = safe_load(path, is_zip)
    if isinstance(obj, Mapping) and not _all_tensors(
        obj
    ):  # a training checkpoint: the model's entry, not a stray tensor beside it
        for key in WRAPPER_KEYS:  # (nanoGPT's ckpt.pt keeps best_val_loss, a tensor, beside "model")
            if _is_state_dict(obj.get(key)):
                return obj, key, obj[key]
        for key in WRAPPER_KEYS:  # nested dicts of tensors (Megatron-LM's legacy model: language_model/encoder/...)
            if isinstance(obj.get(key), Mapping) and (flat := flatten(obj[key], path)):
                return obj, key, flat
    if _is_state_dict(obj):
        return obj, None, obj
    if isinstance(obj, Mapping):
        keys = ", ".join(map(str, list(obj)[:8]))
        raise CheckpointError(
            f"{path} holds no state dict (top-level keys: {keys}); expected tensors or a 'state_dict'/'model' entry"
        )
    raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors")


MAX_DEPTH = 16  # nested dicts of a state dict (Megatron-LM's legacy model has 3 levels)


def flatten(tree: Mapping, path: Path, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """The tensors of a state dict kept as nested dicts, under their dotted paths
    (``language_model.encoder.layers.0.self_attention.query_key_value.weight``); two alike are refused."""
    import torch

    if depth > MAX_DEPTH:
        raise CheckpointError(f"{path}: its state dict nests dicts more than {MAX_DEPTH} deep; surgeon reads no deeper")
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        inner = flatten(value, path, name + ".", depth + 1) if isinstance(value, Mapping) else {}
        if isinstance(value, torch.Tensor):
            inner = {name: value}
        if out.keys() & inner.keys():
            raise CheckpointError(
                f"{path}: two tensors of its nested state dict are both named {min(out.keys() & inner.keys())!r}"
            )
        out.update(inner)
    return out


def nest(tree: Mapping, new: Mapping, prefix: str = "") -> Mapping:
    """``tree`` (nested dicts) with each tensor replaced by ``new``'s value of its dotted path; every dict
    along the way copied (its type, order and attributes kept), everything else as it was."""
    out = copy.copy(tree)
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out[key] = nest(value, new, name + ".")  # type: ignore[index]
        elif name in new:
            out[key] = new[name]  # type: ignore[index]
    return out


def safe_load(path: Path, is_zip: bool) -> Any:
    """``torch.load(weights_only=True)`` of ``path``, admitting Megatron's argparse.Namespace and nothing
    else beyond weights_only's own; a pickle that asks for more is refused in one line, nothing run."""
    import torch

    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
        except pickle.UnpicklingError:
            unsafe = _unsafe_globals(path)
            if not unsafe or not set(unsafe) <= set(SAFE_EXTRA_GLOBALS):
                raise
            import argparse

            with torch.serialization.safe_globals([argparse.Namespace]):  # this load only
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as exc:
        unsafe = [g for g in _unsafe_globals(path) or () if g not in SAFE_EXTRA_GLOBALS]
        detail = f" (it asks for {', '.join(unsafe[:4])})" if unsafe else _unsafe_detail(str(exc))
        raise CheckpointError(
            f"{path} cannot be loaded safely{detail}: surgeon loads pickles with weights_only=True and never "
            "runs code from a file; re-save it as a plain state dict or as safetensors"
        ) from None
    except Exception as exc:  # torch raises RuntimeError/EOFError/... for damaged files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({first[:160]}); re-download or re-save it"
        ) from None
    return obj


def _unsafe_globals(path: Path) -> list[str] | None:
    """The globals the pickle names beyond weights_only's (read statically: nothing is loaded), or None."""
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # a damaged file: the load's own error stands
        return None


def _all_tensors(obj: Mapping) -> bool:
    import torch

    return all(isinstance(v, torch.Tensor) for v in obj.values())


def container_config(obj: object) -> dict | None:
    """The model's arguments a training checkpoint keeps beside its weights (nanoGPT ``model_args``,
    Lightning ``hyper_parameters``): head counts in config.json terms (n_head, num_heads, ...)."""
    if not isinstance(obj, Mapping):
        return None
    import argparse

    if isinstance(obj.get(MEGATRON_ARGS), argparse.Namespace):  # Megatron's loader reads no version as 0
        return megatron_config(vars(obj[MEGATRON_ARGS]), obj.get(MEGATRON_CHECKPOINT_VERSION, 0))
    for key in CONFIG_KEYS:
        value = obj.get(key)
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {k: v for k, v in value.items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    return None


# Megatron-LM's arguments saying that one file holds one rank's part of each layer (tensor parallel) or only
# some layers, numbered from 0 within the stage (pipeline parallel): not the model surgeon would number and cut.
MEGATRON_PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def refuse_rank_part(obj: object, file: str) -> None:
    """Refuse a Megatron-LM legacy file that is one rank's part of a model (``mp_rank_XX[_YYY]``): its
    query_key_value holds that rank's heads only, and its layers are the stage's own, numbered from 0."""
    import argparse

    args = obj.get(MEGATRON_ARGS) if isinstance(obj, Mapping) else None
    if not isinstance(args, argparse.Namespace):
        return
    split = {k: v for k in MEGATRON_PARALLEL_ARGS if isinstance(v := getattr(args, k, 1), int) and v > 1}
    if split:
        said = ", ".join(f"{k}={v}" for k, v in split.items())
        raise CheckpointError(
            f"{file} is one rank's part of a Megatron-LM checkpoint saved with {said}: it holds a slice of each "
            "layer's heads or some of the layers, not the model; merge the ranks into one (Megatron-LM's "
            "tools/checkpoint/convert.py --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1) "
            "and run surgeon on that"
        )


def megatron_config(args: Mapping, version: object = None) -> dict:
    """Megatron-LM's training arguments in config.json terms. Its num_query_groups counts only with
    group_query_attention (arguments.py core_transformer_config_from_args; its default is 1 either way)."""
    plain = {k: v for k, v in args.items() if isinstance(k, str) and isinstance(v, (int, float, str, bool))}
    config: dict[str, object] = {
        k: plain[k] for k in ("num_attention_heads", "kv_channels", "hidden_size", "num_layers") if k in plain
    }
    heads = config.get("num_attention_heads")
    if isinstance(heads, int):
        groups = plain.get("num_query_groups") if plain.get("group_query_attention") is True else heads
        if isinstance(groups, int):
            config["num_key_value_heads"] = groups
    if isinstance(
        version, (int, float, str)
    ):  # how a legacy query_key_value packs its rows (config_keys.MEGATRON_LEGACY_QKV)
        config[MEGATRON_CHECKPOINT_VERSION] = version
    return config


def _unsafe_detail(message: str) -> str:
    for line in message.splitlines():
        line = line.strip()
        if "GLOBAL" in line or "Unsupported" in line:
            return f" (it asks for {line[:120]})"
    return " (it needs code execution)"


class TorchWeights(WeightSet):
    format = "torch"
    patches_in_place = False  # torch.save rewrites the whole file
    rewrites_whole_tensors = True
    graph = False
    record_slot = False  # torch files have no metadata slot loaders ignore: a folder's model card carries the record
    shard_suffix = TORCH_SUFFIXES[0]

    def __init__(self, folder: Path, files: list[str], index: str | None = None) -> None:
        import torch

        super().__init__(folder, files, index)
        self._loaded: dict[str, tuple[Any, str | None, Any]] = {}  # file -> (object, state-dict key, state dict)
        found: dict[str, str] = {}
        for file in files:
            if not (folder / file).is_file():
                raise CheckpointError(
                    f"missing shard {file}: {index or 'the checkpoint'} lists it but it is not in {folder}"
                )
            loaded = self._loaded[file] = load_file(folder / file)
            refuse_rank_part(loaded[0], file)
            for name, value in loaded[2].items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name in found:
                    raise CheckpointError(f"tensor {name!r} is in both {found[name]} and {file}")
                found[name] = file
                nbytes = value.numel() * value.element_size()
                self._infos[name] = TensorInfo(
                    name,
                    tuple(value.shape),
                    str(value.dtype).removeprefix("torch."),
                    str(value.dtype).removeprefix("torch."),
                    file,
                    nbytes,
                )
        self._check_index(found)
        # Megatron-Core's stacked-layer tensors (dcp_to_torch_save of a torch_dist checkpoint), layer by layer
        self._infos, self.slices = unstack(self._infos, index or (folder / files[0]))
        self.notes += stacked_note(self.slices)

    def embedded_config(self) -> dict | None:
        """nanoGPT's model_args / Lightning's hyper_parameters of a single-file training checkpoint."""
        return container_config(self._loaded[self.files[0]][0]) if len(self.files) == 1 else None

    def read(self, name: str) -> torch.Tensor:
        state = self._loaded[self._infos[name].file][2]
        part = self.slices.get(name)
        return state[name] if part is None else state[part.stacked][part.layer]

    def check_non_tensor(self, out: WeightSet, changed: set[str], history: list, output: object) -> None:
        """Files none of whose tensors change are copied as they are: byte for byte. (The rest of a
        rewritten file is what torch.save writes around the tensors; no record is stored in it.)"""
        for mine, theirs in zip(self.files, out.files):
            if not any(self.tensors[n].file == mine for n in changed) and not same_bytes(
                self.folder / mine, out.folder / theirs
            ):
                raise VerificationError(
                    f"{output}: {theirs} differs from the original's, and surgeon copies it as it is (none of its tensors change)"
                )

    def save(self, dest: Path, updates: UpdatesFn, record: dict, write_plan: WritePlan) -> None:
        import shutil

        import torch

        # torch files have no metadata slot that loaders ignore, so the record is not embedded here.
        for file in self.files:
            changes = dict(updates(file))
            if not changes:
                shutil.copyfile(self.folder / file, dest / file)
                continue
            obj, key, state = self._loaded[file]
            new_state = state.copy()  # same type (dict / OrderedDict), same key order
            for name, tensor in changes.items():
                old = self.read(name)
                assert tensor.shape == old.shape and tensor.dtype == old.dtype, f"update of {name} changes it"
                part = self.slices.get(name)
                if part is None:
                    new_state[name] = tensor.contiguous()
                    continue
                if new_state[part.stacked] is state[part.stacked]:  # the other layers' slices as they were
                    new_state[part.stacked] = state[part.stacked].clone()
                new_state[part.stacked][part.layer] = tensor
            if hasattr(state, "_metadata"):
                new_state._metadata = state._metadata
            if key is not None:
                out = obj.copy()
                out[key] = new_state if obj[key] is state else nest(obj[key], new_state)  # nested: kept so
            else:
                out = new_state
            # Same file name inside the temporary folder: torch names the zip archive after it.
            torch.save(out, dest / file, _use_new_zipfile_serialization=zipfile.is_zipfile(self.folder / file))
        if self.index:
            shutil.copyfile(self.folder / self.index, dest / self.index)
