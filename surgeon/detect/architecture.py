"""A checkpoint's transformers architecture, built from its config.json (random init, nothing downloaded).

Shared by ``inspect --verify-layout`` (surgeon.audit.layout) and ``inspect --jacobian`` (surgeon.compute.jacobian):
the built model, and the map from its in-memory parameter names to the checkpoint's tensor names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from ..errors import CheckpointError, OptionError

if TYPE_CHECKING:
    from ..formats.base import TensorInfo
    from ..open.source import Source


# A model built from a config may hold this much more than the checkpoint (float32 bytes): heads the
# checkpoint leaves out, buffers, an untied output layer the size of the embedding aside.
SLACK_BYTES = 64 << 20
# Config fields that count layers: checked before transformers' config makes per-layer lists from them.
_LAYER_COUNT = re.compile(r"(?:num_|n_)?(?:hidden_|encoder_|decoder_)?layers?")


def build_architecture(
    config: dict, *, purpose: str, tensors: Mapping[str, TensorInfo], where: str = "config.json"
) -> torch.nn.Module:
    """The transformers model that config.json describes, randomly initialized in float32, in eval mode.

    ``purpose``: what needs it, as messages name it (``opt("verify_layout", True)``). Nothing is allocated
    from the config's numbers before they are checked against ``tensors`` (the checkpoint's, by name):
    the model is built on the meta device first, and every parameter and buffer it would hold must have
    the shape of the checkpoint's tensor of that name, or be small; a number no tensor supports is one
    line naming the field (``where``: the config's name).
    """
    try:
        import transformers
    except ImportError:
        raise OptionError(f"{purpose} needs transformers to build the architecture: pip install transformers") from None
    model_type = config.get("model_type")
    if not model_type or not isinstance(model_type, str):
        raise OptionError(f"{purpose} needs config.json to name its model_type (a transformers architecture)")
    _check_counts(config, tensors, purpose, where)
    settings = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **settings)
    except Exception as exc:  # a model_type it does not know, or values its config class refuses
        raise OptionError(
            f"{purpose}: transformers {transformers.__version__} cannot make a {model_type!r} config from {where}: "
            f"{_line(exc)}"
        ) from None
    names = config.get("architectures") or []
    cls = (
        getattr(transformers, names[0], None)
        if isinstance(names, list) and names and isinstance(names[0], str)
        else None
    )
    if cls is None:
        cls = transformers.AutoModel
        build = lambda: cls.from_config(cfg, dtype=torch.float32)  # noqa: E731
    else:
        build = lambda: cls._from_config(cfg, dtype=torch.float32)  # noqa: E731
    label = str(names[0]) if isinstance(names, list) and names else model_type
    transformers.logging.set_verbosity_error()
    _check_against_tensors(_built(build, "meta", label, purpose, tensors, config), tensors, config, purpose, where)
    return _built(build, "cpu", label, purpose, tensors, config).float().eval()


def _built(
    build: Callable[[], torch.nn.Module],
    device: str,
    label: str,
    purpose: str,
    tensors: Mapping[str, TensorInfo],
    config: dict,
) -> torch.nn.Module:
    """``build()`` on ``device``; on the meta device with a cap on the modules it makes (a count from the
    config, such as experts kept as modules, cannot make it build millions)."""
    cap = 64 * len(tensors) + 4096
    count = [0]

    def counted(module: torch.nn.Module, name: str, submodule: torch.nn.Module) -> None:
        count[0] += 1
        if count[0] > cap:
            raise _TooManyModules
        return None

    hook = torch.nn.modules.module.register_module_module_registration_hook(counted) if device == "meta" else None
    try:
        with torch.device(device):
            return build()
    except _TooManyModules:
        field = _field_over(config, len(tensors))
        raise CheckpointError(
            f"{purpose}: {label} as configured would have more than {cap} modules for a checkpoint of {len(tensors)} "
            f"tensors{f' ({field} is more than any tensor supports)' if field else ''}; is the config this checkpoint's?"
        ) from None
    except Exception as exc:  # an architecture transformers cannot build from this config
        raise OptionError(f"{purpose}: cannot build {label} from config.json: {_line(exc)}") from None
    finally:
        if hook is not None:
            hook.remove()


class _TooManyModules(Exception):
    pass


def _line(exc: Exception) -> str:
    """An exception from transformers or torch as one short line (theirs may span many)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _int_fields(config: dict, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(dotted key, value) of every count in a config, sub-configs included (their nesting is capped on reading)."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _int_fields(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def _field_over(config: dict, bound: int) -> str | None:
    fields = [(value, key) for key, value in _int_fields(config) if value > bound]
    return "{1}={0}".format(*max(fields)) if fields else None


def _check_counts(config: dict, tensors: Mapping[str, TensorInfo], purpose: str, where: str) -> None:
    """A layer holds one tensor at least: more layers than tensors is a number no tensor supports; so is
    a number past what a tensor's size can be (torch's sizes are 64-bit)."""
    for key, value in _int_fields(config):
        if abs(value) >= 1 << 63:
            raise CheckpointError(f"{purpose}: {where} says {key}={value}, more than any size a tensor can have")
        if _LAYER_COUNT.fullmatch(key.rsplit(".", 1)[-1]) and value > len(tensors):
            raise CheckpointError(
                f"{purpose}: {where} says {key}={value}, but the checkpoint has {len(tensors)} tensors: "
                f"is {where} this checkpoint's?"
            )


def _check_against_tensors(
    meta: torch.nn.Module, tensors: Mapping[str, TensorInfo], config: dict, purpose: str, where: str
) -> None:
    """Every tensor of the model built on the meta device has the shape of the checkpoint's tensor of its
    name; the ones the checkpoint lacks (buffers, heads) add up to no more than the checkpoint plus slack."""
    from .module import checkpoint_names

    names = CheckpointNames(checkpoint_names(meta), set(tensors))
    by_tensor: dict[int, tuple[torch.Tensor, list[str]]] = {}  # tied weights: one tensor, several names
    for name, value in [*meta.named_parameters(remove_duplicate=False), *meta.named_buffers(remove_duplicate=False)]:
        by_tensor.setdefault(id(value), (value, []))[1].append(name)
    extra, largest = 0, None
    for value, own in by_tensor.values():
        found = [names(n) for n in own if names(n) in tensors]
        for tensor in found:
            if tuple(value.shape) != tuple(tensors[tensor].shape):
                _refuse_shape(tensor, tuple(value.shape), tuple(tensors[tensor].shape), config, purpose, where)
        if not found:
            extra += value.numel() * value.element_size()
            largest = max(largest or (0, own[0], ()), (value.numel(), own[0], tuple(value.shape)))
    budget = 4 * sum(math.prod(t.shape) for t in tensors.values()) + SLACK_BYTES
    if extra > budget and largest is not None:
        _, name, shape = largest
        field = _field_in(config, shape, ())
        raise CheckpointError(
            f"{purpose}: {f'{where} says {field}, and ' if field else ''}the architecture built from {where} would "
            f"hold {extra} bytes in tensors the checkpoint does not have (the largest {name} {list(shape)}), more than "
            f"the checkpoint itself: is {where} this checkpoint's?"
        )


def _field_in(config: dict, needed: tuple[int, ...], stored: tuple[int, ...]) -> str | None:
    """The config field whose value is a size of ``needed`` that ``stored`` does not have, the largest
    such size first (``key=value``)."""
    sizes = {n for i, n in enumerate(needed) if len(needed) != len(stored) or stored[i] != n}
    fields = list(_int_fields(config))
    for size in sorted(sizes, reverse=True):
        hits = [f"{key}={value}" for key, value in fields if value == size and value > 1]
        if hits:
            return hits[0]
    return None


def _refuse_shape(
    tensor: str, needed: tuple[int, ...], stored: tuple[int, ...], config: dict, purpose: str, where: str
) -> None:
    field = _field_in(config, needed, stored)
    says = f"{where} says {field}, but" if field else f"the architecture built from {where} does not fit:"
    raise CheckpointError(
        f"{purpose}: {says} the checkpoint's {tensor} is {list(stored)} (the architecture needs {list(needed)}): "
        f"is {where} this checkpoint's?",
        tensor=tensor,
    )


def config_name(source: Source) -> str:
    """How messages name a source's config: its file name, or where its numbers came from."""
    return source.config_path.name if source.config_path is not None else "the model arguments saved in the checkpoint"


class CheckpointNames:
    """In-memory parameter names of the built model -> tensor names of the checkpoint."""

    def __init__(self, renames: dict[str, str], tensors: set[str]) -> None:
        self.renames, self.tensors = renames, tensors

    def __call__(self, name: str) -> str:
        name = self.renames.get(name, name)
        if name in self.tensors:
            return name
        # the checkpoint of a base model under a head model's class, or the other way round
        hits = [t for t in self.tensors if t.endswith("." + name) or name.endswith("." + t)]
        return hits[0] if len(hits) == 1 else name
