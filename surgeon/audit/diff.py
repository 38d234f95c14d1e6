"""``surgeon diff A B``: what changed between two checkpoints of the same model, tensor by tensor and, for the
attention projections, head by head.

It answers "what did fine-tuning change since the reset" and "did my loader silently re-initialize something"
(transformers re-initializes weights it thinks missing: compare a model saved after ``from_pretrained`` with its
source). Every tensor is compared by its stored bytes: identical or changed (with the relative change
``||B - A|| / ||A||``). For each attention projection whose tensor changed (found in A as every command finds
it), each head's relative change and its condition number (kappa, largest over smallest singular value) in A
and in B.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..detect import detect_source
from ..detect.hints import HintInput, Hints
from ..errors import NoAttentionFoundError
from ..hub.read import open_model
from .values import raw

if TYPE_CHECKING:
    import torch

    from ..formats.base import WeightSet


@dataclass(frozen=True)
class TensorChange:
    """One tensor: ``identical`` (same bytes), ``changed`` (``relative``: ||B - A|| / ||A||), or only in A or B,
    or of another shape or dtype in B (``other shape``)."""

    name: str
    status: str
    relative: float | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "relative_change": self.relative}


@dataclass(frozen=True)
class HeadChange:
    """One head of an attention projection: its relative change and its kappa in A and in B."""

    module: str
    layer: int
    role: str
    head: int
    relative: float
    kappa_a: float
    kappa_b: float

    def to_dict(self) -> dict:
        return {"module": self.module, "layer": self.layer, "role": self.role, "head": self.head,
            "relative_change": self.relative, "kappa_a": self.kappa_a, "kappa_b": self.kappa_b}  # fmt: skip


@dataclass(frozen=True)
class Diff:
    """What differs between checkpoints ``a`` and ``b``: every tensor, and the heads of the changed attention
    projections."""

    a: str
    b: str
    tensors: tuple[TensorChange, ...]
    heads: tuple[HeadChange, ...]

    @property
    def changed(self) -> list[str]:
        """The tensors that are not byte-identical in A and B (changed, or only in one, or of another shape)."""
        return [t.name for t in self.tensors if t.status != "identical"]

    @property
    def identical(self) -> bool:
        return not self.changed

    def summary(self) -> str:
        """One line."""
        from ..text.shown import shown

        kinds: dict[str, int] = {}
        for t in self.tensors:
            kinds[t.status] = kinds.get(t.status, 0) + 1
        counts = ", ".join(f"{n} {status}" for status, n in kinds.items())
        return shown(f"{self.a} -> {self.b}: {len(self.tensors)} tensors, {counts}")

    def lines(self) -> list[str]:
        """The summary, each tensor that differs, then each head of the changed attention projections."""
        from ..text.shown import shown

        out = [self.summary()]
        for t in self.tensors:
            if t.status != "identical":
                rel = f" (relative change {t.relative:.4g})" if t.relative is not None else ""
                out.append(shown(f"  {t.status}: {t.name}{rel}"))
        if self.heads:
            out.append("attention heads of the changed projections (relative change; kappa in A -> in B):")
            out += [
                shown(
                    f"  {h.module} {h.role} head {h.head}: {h.relative:.4g}; kappa {h.kappa_a:.4g} -> {h.kappa_b:.4g}"
                )
                for h in self.heads
            ]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "changed": self.changed, "tensors": [t.to_dict() for t in self.tensors],
            "heads": [h.to_dict() for h in self.heads]}  # fmt: skip


def diff(
    a: str | Path,
    b: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    hints: Hints | None = None,
    device: Any = "cpu",
    **hint_keywords: HintInput | bool,
) -> Diff:
    """Compare checkpoints ``a`` and ``b`` (paths or Hub ids, any format surgeon reads) tensor by tensor, and the
    heads of the attention projections that changed.

    Args:
        a: The checkpoint compared against (the base, the reset point).
        b: The checkpoint compared with it (the fine-tuned model, a re-saved copy).
        revision: A's Hub revision (default: main).
        config: A config.json to read A's heads from (default: the one beside the weights).
        hints: What A's config.json does not say (a :class:`~surgeon.detect.hints.Hints`).
        device: Unused (the heads are measured on the CPU); taken so that the CLI's model options pass through.
        **hint_keywords: Fields of Hints, replacing those of ``hints``.

    Returns:
        The differences (``str()`` prints them; ``.to_dict()`` for JSON).

    Raises:
        CheckpointError: A checkpoint cannot be read.
        HubError: A Hub model cannot be fetched.
    """
    hints = Hints.build(hints, **hint_keywords)
    src_a = open_model(a, config=config, revision=revision)
    src_b = open_model(b)
    wa, wb = src_a.primary, src_b.primary
    tensors = [_tensor_change(wa, wb, name) for name in sorted(set(wa.tensors) | set(wb.tensors))]
    status = {t.name: t.status for t in tensors}
    try:
        blocks = tuple(detect_source(src_a, hints).blocks)
    except NoAttentionFoundError:  # a model without attention still has tensors to compare
        blocks = ()
    heads = []
    for block in blocks:
        for p in block.projections:
            if status.get(p.weight.tensor) != "changed":
                continue
            ta, tb = wa.read(p.weight.tensor), wb.read(p.weight.tensor)
            for h in range(p.heads):
                rows = p.weight.head_slice(h)
                ha, hb = _head(ta, p.weight.axis, rows), _head(tb, p.weight.axis, rows)
                heads.append(
                    HeadChange(block.module, block.layer, p.role, h, _relative(ha, hb), _kappa(ha), _kappa(hb))
                )
    return Diff(str(a), str(b), tuple(tensors), tuple(heads))


def _tensor_change(wa: WeightSet, wb: WeightSet, name: str) -> TensorChange:
    if name not in wb.tensors:
        return TensorChange(name, "only in A")
    if name not in wa.tensors:
        return TensorChange(name, "only in B")
    ia, ib = wa.tensors[name], wb.tensors[name]
    if tuple(ia.shape) != tuple(ib.shape) or ia.element != ib.element:
        return TensorChange(name, "other shape")
    if raw(wa, name) == raw(wb, name):
        return TensorChange(name, "identical")
    ta, tb = wa.read(name), wb.read(name)
    return TensorChange(name, "changed", _relative(ta, tb) if ta.is_floating_point() else None)


def _head(t: torch.Tensor, axis: int, rows: slice) -> torch.Tensor:
    head = t[rows] if axis == 0 else t[:, rows].T
    return head.double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    norm = float(a.norm())
    return float((b - a).norm()) / norm if norm else float("inf")


def _kappa(head: torch.Tensor) -> float:
    import torch

    from ..vocab.spectrum import kappa_from

    s = torch.linalg.svdvals(head)
    return kappa_from(float(s[0]), float(s[-1]))
