"""Carry out a plan on tensors: the only place where weights change.

Works tensor by tensor (a fused tensor gets all of its query/key/value edits at once), computes in
float64 on the chosen device and stores back in the tensor's own dtype. Condition numbers are taken
from the original and from the stored result, so the "after" column is what the file holds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .conditioning import Spectrum, head_seed, polar, rescale_to, semi_orthogonal, spectrum, value_identity
from .errors import OptionError
from .plan import Change, Plan
from .spec import AttentionBlock, Projection, Rows


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise OptionError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"--device {device}: no CUDA device is available here; use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise OptionError(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    return dev


def head_matrices(tensor: torch.Tensor, rows: Rows, heads: list[int] | tuple[int, ...] | None = None) -> torch.Tensor:
    """The per-head matrices ``(H, d, in)`` of a projection, in PyTorch (out, in) orientation."""
    heads = range(len(rows.offsets)) if heads is None else heads
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)
    return torch.stack([mat[rows.head_slice(h)] for h in heads])


def _set_heads(tensor: torch.Tensor, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> None:
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)  # a view: writes land in tensor
    for h, value in zip(heads, values):
        mat[rows.head_slice(h)] = value


def new_heads(change: Change, old: torch.Tensor, plan: Plan, *, seed_name: str | None = None) -> torch.Tensor:
    """New per-head matrices for ``change.heads`` given their old values ``(len(heads), d, in)``.

    Draws are keyed by ``seed_name`` (default: the tensor's own name), so that a model in memory whose
    parameter names differ from its checkpoint's can draw exactly what the checkpoint path draws.
    """
    opts, proj = plan.options, change.projection
    d, n_in = proj.head_dim, proj.in_features
    if opts.mode == "polar":
        new = polar(old, opts.effective_strength)
    elif change.role == "v":
        new = torch.stack([value_identity(h, d, n_in, opts.value_identity, device=old.device) for h in change.heads])
    else:
        key = seed_name or proj.weight.tensor
        seeds = [head_seed(opts.seed, key, change.role, h) for h in change.heads]
        new = torch.stack([semi_orthogonal(d, n_in, seed=s, device=old.device) for s in seeds])
    return rescale_to(new, old) if opts.keep_scale else new


@dataclass
class ProjectionResult:
    block: AttentionBlock
    role: str
    heads: tuple[int, ...]  # heads that changed
    dtype: str
    before: Spectrum
    after: Spectrum | None
    bias_zeroed: bool

    @property
    def projection(self) -> Projection:
        return self.block.projection(self.role)


class Engine:
    """Applies a plan to tensors given one at a time, remembering before/after spectra."""

    def __init__(self, plan: Plan, device: torch.device, *, seed_names: Mapping[str, str] | None = None) -> None:
        self.plan = plan
        self.device = device
        self.seed_names = dict(seed_names or {})  # tensor -> name its draws are keyed by (see new_heads)
        self.edits: dict[str, list[tuple[Change, str]]] = defaultdict(list)
        for change in plan.changes:
            proj = change.projection
            self.edits[proj.weight.tensor].append((change, "weight"))
            if plan.options.zero_bias and proj.bias is not None:
                self.edits[proj.bias.tensor].append((change, "bias"))
        self.results: dict[tuple[str, str], ProjectionResult] = {}

    @property
    def tensor_names(self) -> list[str]:
        return list(self.edits)

    def update(self, name: str, original: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """The new value of tensor ``name`` (same shape and dtype as ``original``, on its device)."""
        work = original.detach().to(self.device, torch.float64, copy=True)
        edits = self.edits[name]
        for change, what in edits:
            proj = change.projection
            if what == "bias":
                for h in change.heads:
                    work[proj.bias.head_slice(h)] = 0.0
                continue
            old = head_matrices(work, proj.weight, change.heads)
            new = new_heads(change, old, self.plan, seed_name=self.seed_names.get(name))
            _set_heads(work, proj.weight, change.heads, new)
        stored = work.to(original.dtype).to(original.device)
        if record:
            self._record(name, original, stored, edits)
        return stored

    def _record(self, name: str, original: torch.Tensor, stored: torch.Tensor, edits) -> None:
        for change, what in edits:
            key = (change.block.module, change.role)
            proj = change.projection
            if what == "weight":
                before = spectrum(head_matrices(original.to(self.device), proj.weight))
                after = spectrum(head_matrices(stored.to(self.device), proj.weight))
                prev = self.results.get(key)
                self.results[key] = ProjectionResult(change.block, change.role, change.heads, str(original.dtype).removeprefix("torch."), before, after, prev.bias_zeroed if prev else False)
            elif key in self.results:
                self.results[key].bias_zeroed = True
            else:  # bias stored before its weight (another shard): mark it for when the weight comes
                self.results[key] = ProjectionResult(change.block, change.role, change.heads, "", None, None, True)  # type: ignore[arg-type]

    def ordered_results(self) -> list[ProjectionResult]:
        return [self.results[(c.block.module, c.role)] for c in self.plan.changes if (c.block.module, c.role) in self.results]


def inspect_blocks(blocks: list[AttentionBlock], read: Callable[[str], torch.Tensor], device: torch.device, progress=None) -> dict[tuple[str, str], Spectrum]:
    """Spectra of every projection of every block, reading each tensor once."""
    by_tensor: dict[str, list[tuple[AttentionBlock, Projection]]] = defaultdict(list)
    for block in blocks:
        for proj in block.projections:
            by_tensor[proj.weight.tensor].append((block, proj))
    out: dict[tuple[str, str], Spectrum] = {}
    for name, users in by_tensor.items():
        tensor = read(name).to(device, torch.float64)
        for block, proj in users:
            out[(block.module, proj.role)] = spectrum(head_matrices(tensor, proj.weight))
        if progress is not None:
            progress(1)
    return out
