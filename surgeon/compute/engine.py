"""Carry out a plan on tensors: the only place where weights change.

Works tensor by tensor (a fused tensor gets all of its query/key/value edits at once), computes in
float64 on the chosen device and stores back in the tensor's own dtype. Condition numbers are taken
from the original and from the stored result, so the "after" column is what the file holds.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import UnsupportedWeightsError, opt
from ..modes import get_mode
from ..modes.base import Draw, mixed
from ..modes.conditioning import (
    Spectrum,
    head_kappas,
    rescale_to,
    single_threaded,
    spectrum,
)
from ..plan.planner import Plan
from ..vocab.blocks import AttentionBlock, Projection, Rows
from ..vocab.change import Change
from ..vocab.selection import format_indices
from ..vocab.spectrum import ProjectionRow


def _row_index(rows: Rows, heads: Sequence[int], device: torch.device | str) -> torch.Tensor:
    starts = torch.tensor([rows.offsets[h] for h in heads], dtype=torch.long)
    return (starts[:, None] + torch.arange(rows.size)).reshape(-1).to(device)


def head_matrices(tensor: torch.Tensor, rows: Rows, heads: Sequence[int] | None = None) -> torch.Tensor:
    """The per-head matrices ``(H, d, in)`` of a projection, in PyTorch (out, in) orientation (a copy)."""
    chosen = range(len(rows.offsets)) if heads is None else heads
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)
    # (H, d, in); a bias: (H, d)
    return mat.index_select(0, _row_index(rows, chosen, tensor.device)).reshape(len(chosen), rows.size, *mat.shape[1:2])


def _set_heads(tensor: torch.Tensor, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
    """Store ``values`` (len(heads), d, in) into ``heads``; returns them as stored (rounded to the tensor's dtype)."""
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)  # a view: writes land in tensor
    values = values.to(
        tensor.device, tensor.dtype
    )  # round first: the reshape below then copies (if at all) 2-4x fewer bytes
    mat.index_copy_(
        0, _row_index(rows, heads, tensor.device), values.reshape(-1, *mat.shape[1:])
    )  # (out, in[, 1, 1]): 1x1 convs
    return values


def _zero_heads(tensor: torch.Tensor, rows: Rows, heads: tuple[int, ...]) -> None:
    tensor.index_fill_(0, _row_index(rows, heads, tensor.device), 0)


def new_heads(
    change: Change,
    old: torch.Tensor | None,
    plan: Plan,
    *,
    seed_name: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """New per-head matrices (float64) for ``change.heads``, given their old values ``(len(heads), d, in)``.

    ``old`` is only read where the mode reads it (polar, a mix at strength t < 1) and by ``keep_scale`` (pass None
    otherwise); ``dtype``: how they are stored; ``reference``: the same heads in SOURCE (a restore). Draws are keyed by
    ``seed_name`` (default: the tensor's own name), so that a model in memory whose parameter names
    differ from its checkpoint's can draw exactly what the checkpoint path draws.
    """
    opts, proj = plan.options, change.projection
    device = old.device if old is not None else (device or "cpu")
    job = Draw(change, old, opts, key=seed_name or proj.weight.tensor, device=device, dtype=dtype, reference=reference)
    new = get_mode(opts.mode).heads(job)
    if opts.keep_scale:
        assert old is not None  # needs_old_values: keep_scale reads the old values
        return rescale_to(new, old)
    return new


def needs_old_values(plan: Plan) -> bool:
    return get_mode(plan.options.mode).reads_old(plan.options) or plan.options.keep_scale


@runtime_checkable
class TensorStore(Protocol):
    """Where the engine reads and writes one tensor's heads: a copy in memory, a DTensor's local shards, ...

    ``heads`` returns the values as stored (``head_matrices``' layout); ``set_heads`` stores float64
    values rounded to the tensor's dtype and returns them as stored.
    """

    def heads(self, rows: Rows, heads: Sequence[int] | None = None) -> torch.Tensor: ...

    def set_heads(self, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> torch.Tensor: ...

    def zero_heads(self, rows: Rows, heads: tuple[int, ...]) -> None: ...

    def fill(self, values: torch.Tensor) -> None: ...


class TensorCopy:
    """A tensor in memory: a copy of ``original`` (``copy=False``: the tensor itself) that the edits change."""

    def __init__(self, original: torch.Tensor, *, copy: bool = True) -> None:
        self.tensor = original.clone() if copy else original

    def heads(self, rows: Rows, heads: Sequence[int] | None = None) -> torch.Tensor:
        return head_matrices(self.tensor, rows, heads)

    def set_heads(self, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
        return _set_heads(self.tensor, rows, heads, values)

    def zero_heads(self, rows: Rows, heads: tuple[int, ...]) -> None:
        _zero_heads(self.tensor, rows, heads)

    def fill(self, values: torch.Tensor) -> None:
        self.tensor.copy_(values.to(self.tensor.device, self.tensor.dtype))


class EditKind(enum.Enum):
    """What one edit of a tensor changes (as torch DCP's ``WriteItemType`` says what one write item is)."""

    WEIGHT = "weight"  # the chosen heads' rows of a projection's weight, drawn by the mode
    BIAS = "bias"  # the chosen heads of a projection's bias, zeroed
    OUT = "out"  # the mode's output projection (mimetic's W_O), drawn whole


class Edit(NamedTuple):
    """One edit of a tensor: the change it carries out, and what it changes."""

    change: Change
    kind: EditKind


class Engine:
    """Applies a plan to tensors given one at a time, remembering before/after spectra.

    ``whole``: also the whole-projection kappa and spectral norm (``--full``).
    """

    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        *,
        whole: bool = False,
    ) -> None:
        self.plan = plan
        self.device = device
        self.whole = whole
        self.seed_names = plan.draw_keys  # the names the draws are keyed by (the model's base names)
        self.edits: dict[str, list[Edit]] = defaultdict(list)
        for change in plan.changes:
            proj = change.projection
            self.edits[proj.weight.tensor].append(Edit(change, EditKind.WEIGHT))
            if plan.options.bias_policy != "keep" and proj.bias is not None:
                self.edits[proj.bias.tensor].append(Edit(change, EditKind.BIAS))
            if change.role == "v" and change.block.module in plan.outputs:  # the mode's W_O (mimetic) too
                self.edits[plan.outputs[change.block.module][0]].append(Edit(change, EditKind.OUT))
        self.results: dict[tuple[str, str], ProjectionRow] = {}
        self._zeroed: set[tuple[str, str]] = set()  # projections whose bias heads were zeroed
        self._source: tuple[str, torch.Tensor] | None = None  # the SOURCE tensor last read (a restore)
        # a recipe: one engine per step, each tensor's steps applied in order to the same copy (read once)
        self.steps = [Engine(step, device, whole=whole) for step in plan.steps]
        if self.steps:
            self.edits = defaultdict(
                list, {n: [e for s in self.steps for e in s.edits.get(n, [])] for n in plan.tensors()}
            )

    @property
    def tensor_names(self) -> list[str]:
        return list(self.edits)

    def update(self, name: str, original: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """The new value of tensor ``name`` (same shape and dtype as ``original``, on its device).

        Only the re-initialized rows are computed (in float64 on the engine's device) and rounded to
        the tensor's dtype; every other element keeps its exact bits.
        """
        store = TensorCopy(original.detach())
        self.update_store(name, store, record=record)
        return store.tensor

    def update_store(self, name: str, store: TensorStore, *, record: bool = True) -> None:
        """Carry out the edits of tensor ``name`` through ``store`` (a copy in memory, a DTensor's shards, ...)."""
        if self.steps:  # a recipe: each step that touches the tensor, in order, on what the earlier ones left
            for step in self.steps:
                if name in step.edits:
                    step.update_store(name, store, record=record)
            return
        with single_threaded():
            for change, what in self.edits[name]:
                proj = change.projection
                if what is EditKind.BIAS and self.plan.options.bias_policy == "source":  # SOURCE's, mixed as the heads
                    assert proj.bias is not None  # a bias edit is planned only for a projection with one
                    stored = store.heads(proj.bias, change.heads)
                    source = self._reference_heads(name, proj.bias, change.heads)
                    new = mixed(stored.to(self.device, torch.float64), source, change.strength, stored.dtype)
                    store.set_heads(proj.bias, change.heads, new)
                elif what is EditKind.BIAS:
                    assert proj.bias is not None  # a bias edit is planned only for a projection with one
                    store.zero_heads(proj.bias, change.heads)
                    self._bias_zeroed(change)
                elif what is EditKind.OUT:  # the mode's output projection (mimetic's W_O), drawn whole
                    options, v = self.plan.options, proj.weight.tensor
                    linear = self.plan.outputs[change.block.module][1]
                    new = get_mode(options.mode).draw_output(
                        change, options, key=self.seed_names.get(v) or v, linear=linear
                    )
                    if change.strength is not None:  # mixed with the old W_O, as the heads are
                        whole = store.heads(Rows(name, 0, (0,), new.shape[0]))[0]
                        new = mixed(whole.to(self.device, torch.float64), new, change.strength, whole.dtype)
                    store.fill(new)
                else:
                    self._update_weight(name, change, store, record)

    def _update_weight(self, name: str, change: Change, store: TensorStore, record: bool) -> None:
        rows = change.projection.weight
        # Rows of one projection are read before they are written: within a fused tensor, the edits of
        # the other projections touch other rows, so these are the original values.
        current = store.heads(rows) if record else None  # every head: the report's spectra
        old, dtype = None, None
        if needs_old_values(self.plan):
            stored = current[list(change.heads)] if current is not None else store.heads(rows, change.heads)
            old, dtype = stored.to(self.device, torch.float64), stored.dtype
            self.refuse_nonfinite(name, change, old)
        seed_name = self.seed_names.get((name, change.role)) or self.seed_names.get(name)
        reference = self._reference_heads(name, rows, change.heads) if self.plan.reference is not None else None
        new = new_heads(
            change, old, self.plan, seed_name=seed_name, device=self.device, dtype=dtype, reference=reference
        )
        rounded = store.set_heads(rows, change.heads, new)
        if current is not None:
            self._record(change, current, rounded)

    def _reference_heads(self, name: str, rows: Rows, heads: tuple[int, ...]) -> torch.Tensor:
        """The same heads of tensor ``name`` in SOURCE (a restore's), float64 on the engine's device; each tensor
        of SOURCE is read once for all its edits."""
        assert self.plan.reference is not None
        if self._source is None or self._source[0] != name:
            self._source = (name, self.plan.reference.weights.read(name))
        return head_matrices(self._source[1], rows, heads).to(self.device, torch.float64)

    def check_values(self, name: str, tensor: torch.Tensor | TensorStore) -> None:
        """Refuse, before anything changes, heads whose old values the plan reads but that hold NaN/Inf.

        For callers that change tensors one by one in place (a module in memory, sharded parameters),
        so that a refusal in a later layer does not leave earlier layers changed.
        """
        if not needs_old_values(self.plan):
            return
        store = tensor if isinstance(tensor, TensorStore) else TensorCopy(tensor.detach(), copy=False)
        for change, what in self.edits[name]:
            if what is EditKind.WEIGHT:
                self.refuse_nonfinite(name, change, store.heads(change.projection.weight, change.heads))

    def refuse_nonfinite(self, name: str, change: Change, old: torch.Tensor) -> None:
        bad = [h for h, ok in zip(change.heads, torch.isfinite(old).flatten(1).all(1).tolist()) if not ok]
        if bad:
            mode = get_mode(self.plan.options.mode)
            how = (
                f"{mode.name} mode"
                if not mode.fresh
                else opt("strength", change.strength)
                if change.strength is not None
                else opt("keep_scale", True)
            )
            raise UnsupportedWeightsError(
                f"{name}: {change.role} head{'s' if len(bad) > 1 else ''} {format_indices(bad)} hold{'' if len(bad) > 1 else 's'} "
                f"NaN or Inf, and {how} needs the old values; re-initialize them with the conditioned reset "
                "(without keep-scale), or repair the weights"
            )

    def _spectrum(self, heads: torch.Tensor, kappas: tuple[float, ...] | None = None) -> Spectrum:
        return spectrum(heads.to(self.device), whole=self.whole, kappas=kappas)

    def _record(self, change: Change, current: torch.Tensor, rounded: torch.Tensor) -> None:
        """Before/after spectra of one projection: ``current`` (every head, as it was), ``rounded`` (the new heads as stored)."""
        key = (change.block.module, change.role)
        before = self._spectrum(current)
        # Heads that did not change keep their bytes, so their kappas are the ones just measured.
        kappas = list(before.head_kappas)
        if change.heads:
            for h, k in zip(change.heads, head_kappas(rounded.to(self.device))):
                kappas[h] = k
        if before.kappa is not None:  # the whole projection, as stored now
            stored = current.clone()
            stored[list(change.heads)] = rounded.to(stored.device)
            after = self._spectrum(stored, tuple(kappas))
        else:
            after = Spectrum(None, tuple(kappas), None)
        dtype = str(current.dtype).removeprefix("torch.")
        self.results[key] = ProjectionRow(
            change.block, change.role, before, after, change.heads, dtype, bias_zeroed=key in self._zeroed,
            strength=change.strength, step=change.step,
        )  # fmt: skip

    def _bias_zeroed(self, change: Change) -> None:
        key = (change.block.module, change.role)
        self._zeroed.add(key)  # the bias may be stored before its weight (another tensor, another shard)
        if key in self.results:
            self.results[key] = replace(self.results[key], bias_zeroed=True)

    @property
    def biases_zeroed(self) -> frozenset[tuple[str, str]]:
        """The (block, role) of every projection whose bias heads this engine zeroed, measured or not: a bias
        may be stored in another file than its weight, and so be written by another rank."""
        return frozenset(self._zeroed).union(*(step.biases_zeroed for step in self.steps))

    def ordered_results(self) -> list[ProjectionRow]:
        if self.steps:
            return [row for step in self.steps for row in step.ordered_results()]
        return [
            self.results[(c.block.module, c.role)]
            for c in self.plan.changes
            if (c.block.module, c.role) in self.results
        ]


def inspect_blocks(
    blocks: Sequence[AttentionBlock],
    read: Callable[[str], torch.Tensor],
    device: torch.device,
    progress: Callable[[int], object] | None = None,
    *,
    whole: bool = False,
) -> dict[tuple[str, str], Spectrum]:
    """Spectra of every projection of every block, reading each tensor once."""
    by_tensor: dict[str, list[tuple[AttentionBlock, Projection]]] = defaultdict(list)
    for block in blocks:
        for proj in block.projections:
            by_tensor[proj.weight.tensor].append((block, proj))
    out: dict[tuple[str, str], Spectrum] = {}
    with single_threaded():
        for name, users in by_tensor.items():
            _inspect_tensor(read(name).to(device), users, out, whole)
            if progress is not None:
                progress(1)
    return out


def _inspect_tensor(
    tensor: torch.Tensor,
    users: list[tuple[AttentionBlock, Projection]],
    out: dict[tuple[str, str], Spectrum],
    whole: bool,
) -> None:
    for block, proj in users:
        out[(block.module, proj.role)] = spectrum(head_matrices(tensor, proj.weight), whole=whole)
