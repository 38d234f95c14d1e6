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

from .conditioning import (
    Spectrum,
    head_kappas,
    head_seed,
    polar,
    rescale_to,
    semi_orthogonal_batch,
    single_threaded,
    spectrum,
    value_identity,
)
from .errors import OptionError, UnsupportedWeightsError, opt
from .plan import Change, Plan
from .selection import format_indices
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
            raise OptionError(f"{opt('device', device)}: no CUDA device is available here; use {opt('device', 'cpu')} or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError(f"{opt('device', device)}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise OptionError(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    return dev


def _row_index(rows: Rows, heads, device) -> torch.Tensor:
    starts = torch.tensor([rows.offsets[h] for h in heads], dtype=torch.long)
    return (starts[:, None] + torch.arange(rows.size)).reshape(-1).to(device)


def head_matrices(tensor: torch.Tensor, rows: Rows, heads: list[int] | tuple[int, ...] | None = None) -> torch.Tensor:
    """The per-head matrices ``(H, d, in)`` of a projection, in PyTorch (out, in) orientation (a copy)."""
    chosen = range(len(rows.offsets)) if heads is None else heads
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)
    return mat.index_select(0, _row_index(rows, chosen, tensor.device)).reshape(len(chosen), rows.size, mat.shape[1])


def _set_heads(tensor: torch.Tensor, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> None:
    mat = tensor if rows.axis == 0 else tensor.transpose(0, 1)  # a view: writes land in tensor
    values = values.to(tensor.device, tensor.dtype)  # round first: the reshape below then copies (if at all) 2-4x fewer bytes
    mat.index_copy_(0, _row_index(rows, heads, tensor.device), values.reshape(-1, *mat.shape[1:]))  # (out, in[, 1, 1]): 1x1 convs


def _zero_heads(tensor: torch.Tensor, rows: Rows, heads: tuple[int, ...]) -> None:
    tensor.index_fill_(0, _row_index(rows, heads, tensor.device), 0)


def new_heads(change: Change, old: torch.Tensor | None, plan: Plan, *, seed_name: str | None = None, device=None) -> torch.Tensor:
    """New per-head matrices (float64) for ``change.heads``, given their old values ``(len(heads), d, in)``.

    ``old`` is only read by polar mode and ``keep_scale`` (pass None otherwise). Draws are keyed by
    ``seed_name`` (default: the tensor's own name), so that a model in memory whose parameter names
    differ from its checkpoint's can draw exactly what the checkpoint path draws.
    """
    opts, proj = plan.options, change.projection
    d, n_in = proj.head_dim, proj.in_features
    device = old.device if old is not None else (device or "cpu")
    if opts.mode == "polar":
        assert old is not None  # needs_old_values: polar mode reads the old values
        new = polar(old, opts.effective_strength)
    elif opts.mode == "redraw":
        from .baselines import redraw_heads

        new = redraw_heads(change, seed_name or proj.weight.tensor, opts, device=device)
    elif opts.mode == "mimetic":
        from .baselines import mimetic_heads, module_key

        new = mimetic_heads(change, module_key(change.block, proj.weight.tensor, seed_name), opts, device=device)
    elif change.role == "v":
        new = torch.stack([value_identity(h, d, n_in, opts.value_identity, device=device) for h in change.heads])
    else:
        key = seed_name or proj.weight.tensor
        new = semi_orthogonal_batch(d, n_in, [head_seed(opts.seed, key, change.role, h) for h in change.heads], device=device)
        if opts.gain is not None and opts.gain != 1:
            new = new * float(opts.gain)
    if opts.keep_scale:
        assert old is not None  # needs_old_values: keep_scale reads the old values
        return rescale_to(new, old)
    return new


def needs_old_values(plan: Plan) -> bool:
    return plan.options.mode == "polar" or plan.options.keep_scale


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
    """Applies a plan to tensors given one at a time, remembering before/after spectra.

    ``whole``: also the whole-projection kappa and spectral norm (``--full``).
    """

    def __init__(self, plan: Plan, device: torch.device, *, seed_names: Mapping[str, str] | None = None, whole: bool = False) -> None:
        self.plan = plan
        self.device = device
        self.whole = whole
        self.seed_names = dict(seed_names or {})  # tensor -> name its draws are keyed by (see new_heads)
        self.edits: dict[str, list[tuple[Change, str]]] = defaultdict(list)
        for change in plan.changes:
            proj = change.projection
            self.edits[proj.weight.tensor].append((change, "weight"))
            if plan.options.zero_bias and proj.bias is not None:
                self.edits[proj.bias.tensor].append((change, "bias"))
            if change.role == "v" and change.block.module in plan.outputs:  # mimetic: W_O too
                self.edits[plan.outputs[change.block.module][0]].append((change, "out"))
        self.results: dict[tuple[str, str], ProjectionResult] = {}

    @property
    def tensor_names(self) -> list[str]:
        return list(self.edits)

    def update(self, name: str, original: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """The new value of tensor ``name`` (same shape and dtype as ``original``, on its device).

        Only the re-initialized rows are computed (in float64 on the engine's device) and rounded to
        the tensor's dtype; every other element keeps its exact bits.
        """
        with single_threaded():
            return self._update(name, original.detach(), record)

    def _update(self, name: str, original: torch.Tensor, record: bool) -> torch.Tensor:
        stored = original.clone()
        edits = self.edits[name]
        before: dict[tuple[str, str], Spectrum] = {}
        for change, what in edits:
            proj = change.projection
            if what == "bias":
                assert proj.bias is not None  # a bias edit is planned only for a projection with one
                _zero_heads(stored, proj.bias, change.heads)
                continue
            if what == "out":
                from .baselines import mimetic_out, module_key

                v = proj.weight.tensor
                key = module_key(change.block, v, self.seed_names.get(v))
                stored.copy_(mimetic_out(change.block, key, self.plan.options, self.plan.outputs[change.block.module][1]).to(stored.device, stored.dtype))
                continue
            if record:
                before[(change.block.module, change.role)] = self._spectrum(head_matrices(original, proj.weight))
            old = None
            if needs_old_values(self.plan):
                old = head_matrices(original, proj.weight, change.heads).to(self.device, torch.float64)
                self.refuse_nonfinite(name, change, old)
            new = new_heads(change, old, self.plan, seed_name=self.seed_names.get(name), device=self.device)
            _set_heads(stored, proj.weight, change.heads, new)
        if record:
            self._record(stored, edits, before)
        return stored

    def check_values(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, before anything changes, heads whose old values the plan reads but that hold NaN/Inf.

        For callers that change tensors one by one in place (a module in memory), so that a refusal
        in a later layer does not leave earlier layers changed.
        """
        if not needs_old_values(self.plan):
            return
        for change, what in self.edits[name]:
            if what == "weight":
                self.refuse_nonfinite(name, change, head_matrices(tensor.detach(), change.projection.weight, change.heads))

    def refuse_nonfinite(self, name: str, change: Change, old: torch.Tensor) -> None:
        bad = [h for h, ok in zip(change.heads, torch.isfinite(old).flatten(1).all(1).tolist()) if not ok]
        if bad:
            how = "polar mode" if self.plan.options.mode == "polar" else opt("keep_scale", True)
            raise UnsupportedWeightsError(
                f"{name}: {change.role} head{'s' if len(bad) > 1 else ''} {format_indices(bad)} hold{'' if len(bad) > 1 else 's'} "
                f"NaN or Inf, and {how} needs the old values; re-initialize them with the conditioned reset "
                "(without keep-scale), or repair the weights"
            )

    def _spectrum(self, heads: torch.Tensor, kappas: tuple[float, ...] | None = None) -> Spectrum:
        return spectrum(heads.to(self.device), whole=self.whole, kappas=kappas)

    def _record(self, stored: torch.Tensor, edits, before: dict[tuple[str, str], Spectrum]) -> None:
        for change, what in edits:
            key = (change.block.module, change.role)
            proj = change.projection
            if what == "out":  # W_O is not a q/k/v projection: the report lists it in a note
                continue
            if what == "weight":
                # Heads that did not change keep their bytes, so their kappas are the ones just measured.
                kappas = list(before[key].head_kappas)
                if change.heads:
                    for h, k in zip(change.heads, head_kappas(head_matrices(stored, proj.weight, change.heads).to(self.device))):
                        kappas[h] = k
                after = self._spectrum(head_matrices(stored, proj.weight), tuple(kappas)) if before[key].kappa is not None else Spectrum(None, tuple(kappas), None)
                prev = self.results.get(key)
                self.results[key] = ProjectionResult(change.block, change.role, change.heads, str(stored.dtype).removeprefix("torch."), before[key], after, prev.bias_zeroed if prev else False)
            elif key in self.results:
                self.results[key].bias_zeroed = True
            else:  # bias stored before its weight (another shard): mark it for when the weight comes
                self.results[key] = ProjectionResult(change.block, change.role, change.heads, "", None, None, True)  # type: ignore[arg-type]

    def ordered_results(self) -> list[ProjectionResult]:
        return [self.results[(c.block.module, c.role)] for c in self.plan.changes if (c.block.module, c.role) in self.results]


def inspect_blocks(blocks: list[AttentionBlock], read: Callable[[str], torch.Tensor], device: torch.device, progress=None, *, whole: bool = False) -> dict[tuple[str, str], Spectrum]:
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


def _inspect_tensor(tensor: torch.Tensor, users, out: dict, whole: bool) -> None:
    for block, proj in users:
        out[(block.module, proj.role)] = spectrum(head_matrices(tensor, proj.weight), whole=whole)
