"""The weight formats surgeon reads, by file name, in order of preference.

The one table that opening a path (surgeon.open.source) and choosing what to download from the Hub
(surgeon.hub.read) share: a new format is a ``formats/X.py`` with a WeightSet and one :class:`Format` here.
Nothing here imports torch, numpy or onnx; a format's module is imported when a file is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .suffixes import DCP_METADATA, DCP_SUFFIX, SAFETENSORS_INDEX, SAFETENSORS_SUFFIX, TORCH_SUFFIXES

if TYPE_CHECKING:
    from .base import WeightSet

# Files a training run leaves in a model folder that are pickles but not weights.
# (Megatron's common.pt: the run's arguments and counters beside the .distcp files of a DCP checkpoint.)
# optim.pt: the optimizer state OLMo-core's unshard_checkpoint writes beside its model.pt
NOT_WEIGHTS = {
    "training_args.bin",
    "optimizer.pt",
    "optimizer.bin",
    "scheduler.pt",
    "scaler.pt",
    "common.pt",
    "optim.pt",
}
TORCH_NAMES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth", "model.ckpt")
# Weights in formats surgeon does not rewrite.
OTHER_FORMAT_SUFFIXES = (".h5", ".msgpack", ".ot", ".gguf", ".tflite", ".mlmodel")
# Exports of the weights to other runtimes that a model folder may carry: folders by name, files by suffix.
EXPORT_DIRS = frozenset(("onnx", "openvino", "coreml", "tflite", "gguf"))
EXPORT_SUFFIXES = (".xml", ".npz", ".keras")  # OpenVINO, NumPy, Keras


def _is_torch(name: str) -> bool:
    return (
        Path(name).suffix in TORCH_SUFFIXES
        and name not in NOT_WEIGHTS
        and not name.startswith(("rng_state", "optimizer"))
    )


def _pick_safetensors(top: list[str]) -> list[str]:
    st = [n for n in top if n.endswith(SAFETENSORS_SUFFIX)]
    index = sorted(n for n in top if n.endswith(SAFETENSORS_INDEX))
    return index[:1] + st if index or st else []


def _pick_torch(top: list[str]) -> list[str]:
    index = sorted(n for n in top if n.endswith(".bin.index.json") or n.endswith(".pt.index.json"))
    if index:
        return index[:1] + [n for n in top if n.endswith(".bin") and n not in NOT_WEIGHTS]
    named = [n for n in TORCH_NAMES if n in top]
    if named:
        return named[:1]
    others = [n for n in top if _is_torch(n)]
    return others if len(others) == 1 else []


ONNX_DATA = ("_data", ".data")  # external data files are named after the model: model.onnx_data, model.onnx.data


def _pick_onnx(top: list[str]) -> list[str]:
    onnx = sorted(n for n in top if n.endswith(".onnx"))
    if not onnx:
        return []
    # with its external data file, when it has one
    return onnx[:1] + [n for n in top if n.startswith(tuple(onnx[0] + d for d in ONNX_DATA))]


def pick_dcp(top: list[str]) -> list[str]:
    """A DCP folder: its .metadata, then the data files beside it (the metadata names the ones it reads)."""
    distcp = sorted(n for n in top if n.endswith(DCP_SUFFIX))
    return [DCP_METADATA] + distcp if DCP_METADATA in top and distcp else []


@dataclass(frozen=True)
class Format:
    name: str
    weights: Callable[[], type[WeightSet]]  # its WeightSet class, imported on first use
    suffixes: tuple[str, ...]  # of a single weight file
    index_suffixes: tuple[str, ...]  # of an index file over shards (opened as such when given as MODEL)
    pick: Callable[[list[str]], list[str]]  # a folder's top-level names -> this format's files, index first
    alone: bool = False  # read only when the folder holds no other format (ONNX: a graph, not a state dict)
    opener: Callable[[Path], WeightSet] | None = None  # opens the set from its first file, when not the class
    data: tuple[str, ...] = ()  # companion files named after a weight file (ONNX external data: model.onnx_data)

    def weight_set(self) -> type[WeightSet]:
        return self.weights()

    def is_index(self, name: str) -> bool:
        return name.endswith(self.index_suffixes)

    def open(self, folder: Path, picked: list[str]) -> WeightSet:
        """The weight set of files chosen by :attr:`pick` (or one file given by the user)."""
        if self.opener is not None:
            return self.opener(folder / picked[0])
        cls: Any = self.weight_set()
        if self.is_index(picked[0]):
            return cls.from_index(folder / picked[0])
        return cls(folder, picked)


# Each format's class and opener, imported when a file of it is opened (onnx, numpy and torch stay off the
# start-up path), and typed: mypy checks each against what the table expects.
def _safetensors() -> type[WeightSet]:
    from .safetensors import SafetensorsWeights

    return SafetensorsWeights


def _torch() -> type[WeightSet]:
    from .torchfile import TorchWeights

    return TorchWeights


def _dcp() -> type[WeightSet]:
    from .dcp import DcpWeights

    return DcpWeights


def _open_dcp(path: Path) -> WeightSet:
    from .dcp import open_dcp

    return open_dcp(path)


def _onnx() -> type[WeightSet]:
    from .onnx import OnnxWeights

    return OnnxWeights


def _open_onnx(path: Path) -> WeightSet:
    from .onnx import open_onnx

    return open_onnx(path)


FORMATS: tuple[Format, ...] = (  # in order of preference
    Format("safetensors", _safetensors, (SAFETENSORS_SUFFIX,), (SAFETENSORS_INDEX,), _pick_safetensors),
    Format("torch", _torch, TORCH_SUFFIXES, (".bin.index.json", ".pt.index.json"), _pick_torch),
    Format("dcp", _dcp, (DCP_SUFFIX,), (DCP_METADATA,), pick_dcp, opener=_open_dcp),
    Format("onnx", _onnx, (".onnx",), (), _pick_onnx, alone=True, opener=_open_onnx, data=ONNX_DATA),
)


WEIGHT_SUFFIXES = tuple(s for f in FORMATS for s in f.suffixes)
# Suffixes of companion data files (".onnx_data", ".onnx.data").
DATA_SUFFIXES = tuple(s + d for f in FORMATS for s in f.suffixes for d in f.data)
# A folder input reads the state-dict formats side by side (the same weights twice); a top-level file of
# one of them that is not in the set read is another copy of the weights (Mistral's consolidated.safetensors).
STATE_DICT_SUFFIXES = tuple(s for f in FORMATS if not f.alone for s in f.suffixes + f.index_suffixes)
# The formats read only alone (ONNX): beside a state dict they are an export of the old weights.
ALONE_SUFFIXES = tuple(s for f in FORMATS if f.alone for s in f.suffixes) + DATA_SUFFIXES


def format_of(name: str) -> Format | None:
    """The format of a file given by the user: a weight file or an index file."""
    for fmt in FORMATS:
        if fmt.is_index(name) or Path(name).suffix in fmt.suffixes:
            return fmt
    return None


def pick_weights(top: list[str]) -> list[str]:
    """The files of the preferred format in a folder (its top-level names); what the Hub fetches."""
    for fmt in FORMATS:
        picked = fmt.pick(top)
        if picked:
            return picked
    return []


def is_weight(path: str) -> bool:
    """A weight file surgeon reads (a training run's pickles are not)."""
    name = path.rsplit("/", 1)[-1]
    return Path(name).suffix in WEIGHT_SUFFIXES and name not in NOT_WEIGHTS
