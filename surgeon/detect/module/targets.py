"""The parameters a projection op may read, found by the storage its weight operand views (Targets)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ...errors import TensorParallelError


def is_dtensor(t: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist before it is imported
        return False
    from ..._compat import DTensor

    return isinstance(t, DTensor)


def _refuse_parallel(w: torch.Tensor, targets: Targets) -> None:
    """A projection whose weight is still a DTensor inside the forward: tensor parallelism (FSDP2 unshards first)."""
    name = next((n for n, p in zip(targets.names, targets.params, strict=True) if p is w), "a parameter")
    raise TensorParallelError(
        f"{name} enters its projection as a DTensor placed {tuple(getattr(w, 'placements', ()))} (tensor parallelism): "
        "its forward sees each rank's local heads only; pass num_heads=... (and num_kv_heads=...) to read the layout "
        "from the parameter names, or call surgeon.reinit_ before parallelize_module"
    )


class Targets:
    """The parameters a projection op may read, found by storage.

    A sharded (DTensor) parameter has no storage of its own to find: under FSDP2 its module holds a plain
    unsharded tensor while its forward runs, found by a lookup of the parameters as registered then. One
    that reaches an op still a DTensor (tensor parallelism) is refused: its op sees local heads only.
    """

    def __init__(self, module: nn.Module) -> None:
        self.root = module
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        for name, p in module.named_parameters():
            if p.is_floating_point() and p.dim() == 2:
                self.names.append(name)
                self.params.append(p)
        self.index = {name: pid for pid, name in enumerate(self.names)}
        self.sharded = any(is_dtensor(p) for p in module.parameters())
        self._random: dict[tuple[int, int], torch.Tensor] = {}
        self._register()

    def _register(self) -> None:
        """Storage -> parameters, for the tensors registered now (plain ones: a DTensor has no storage to read)."""
        self.weights: dict[int, list[int]] = {}
        self.biases: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.live: dict[int, torch.Tensor] = {}
        for name, p in self.root.named_parameters():
            if not p.is_floating_point() or is_dtensor(p) or p.untyped_storage().nbytes() == 0:
                continue
            key = p.untyped_storage().data_ptr()
            if p.dim() == 2 and name in self.index:
                self.weights.setdefault(key, []).append(self.index[name])
                self.live[self.index[name]] = p
            elif p.dim() == 1:
                self.biases.setdefault(key, []).append((name, p))

    def _candidates(self, t: torch.Tensor, biases: bool = False) -> list:
        key = t.untyped_storage().data_ptr()
        if self.sharded:  # FSDP2: the unsharded tensors of the module whose forward runs now, in fresh buffers
            pairs: list[tuple[str, torch.Tensor]] = (
                self.biases.get(key, [])
                if biases
                else [(self.names[pid], self.live[pid]) for pid in self.weights.get(key, [])]
            )
            if not pairs or not all(self._registered(name, p, key) for name, p in pairs):
                self._register()
        return (self.biases if biases else self.weights).get(key, [])

    def _registered(self, name: str, p: torch.Tensor, key: int) -> bool:
        """``p`` is still the parameter ``name`` and still in the buffer ``key`` (not a freed one reused)."""
        try:
            current = self.root.get_parameter(name)
        except AttributeError:
            return False
        return current is p and p.untyped_storage().nbytes() > 0 and p.untyped_storage().data_ptr() == key

    def locate(self, w: Any, out_dim: int) -> tuple[int, int, int] | None:
        """(param number, axis, first row) of a 2-D view ``w`` whose ``out_dim`` indexes output features."""
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        if is_dtensor(w):
            _refuse_parallel(w, self)
            return None
        for pid in self._candidates(w):
            p = self.live[pid]
            rel = w.storage_offset() - p.storage_offset()
            for axis in (0, 1):
                stride, other = p.stride(axis), p.stride(1 - axis)
                if (w.stride(out_dim), w.stride(1 - out_dim)) != (stride, other) or w.shape[1 - out_dim] != p.shape[
                    1 - axis
                ]:
                    continue
                if rel >= 0 and rel % stride == 0 and rel // stride + w.shape[out_dim] <= p.shape[axis]:
                    if p.shape[1 - axis] == 1 and p.shape[axis] == 1:
                        continue
                    return pid, axis, int(rel // stride)
        return None

    def locate_bias(self, b: Any, size: int) -> tuple[str, int] | None:
        if not isinstance(b, torch.Tensor) or b.dim() != 1 or b.shape[0] != size or is_dtensor(b):
            return None
        for name, p in self._candidates(b, biases=True):
            rel = b.storage_offset() - p.storage_offset()
            if b.stride(0) == p.stride(0) and rel >= 0 and rel % p.stride(0) == 0:
                return name, rel // p.stride(0)
        return None

    def random(self, pid: int, axis: int) -> torch.Tensor:
        """A fixed random value per row, bounded away from zero (float32, on the CPU)."""
        key = (pid, axis)
        if key not in self._random:
            gen = torch.Generator().manual_seed(7919 * pid + axis + 1)
            n = self.params[pid].shape[axis]
            sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
            self._random[key] = ((torch.rand(n, generator=gen, dtype=torch.float64) + 0.5) * sign).float()
        return self._random[key]
