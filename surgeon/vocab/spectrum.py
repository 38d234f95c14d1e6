"""Condition numbers as data, and what a report holds about one projection (no torch needed)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .blocks import AttentionBlock, Role, split_module

VALUE_IDENTITIES = ("block", "per-head")


def kappa_from(s_max: float, s_min: float) -> float:
    """sigma_max / sigma_min: inf for a singular matrix, NaN for one holding NaN or Inf."""
    if not (math.isfinite(s_max) and math.isfinite(s_min)):
        return math.nan
    return math.inf if s_min == 0.0 else s_max / s_min


@dataclass(frozen=True)
class Spectrum:
    """Condition numbers of one projection: each of its heads, and (when computed) the whole matrix.

    ``kappa`` and ``norm`` are None when the whole-matrix spectrum was not computed: it is one
    O(D^3) eigensolve for a single number, made only when asked for (``--full``). A head whose
    matrix holds NaN or Inf has kappa NaN ("non-finite").
    """

    kappa: float | None  # of the whole projection (all heads stacked)
    head_kappas: tuple[float, ...]
    norm: float | None  # spectral norm of the whole projection

    @property
    def finite_heads(self) -> tuple[float, ...]:
        return tuple(k for k in self.head_kappas if not math.isnan(k))

    @property
    def nonfinite_heads(self) -> tuple[int, ...]:
        return tuple(h for h, k in enumerate(self.head_kappas) if math.isnan(k))

    @property
    def head_min(self) -> float:
        return min(self.finite_heads, default=math.nan)

    @property
    def head_median(self) -> float:
        finite = self.finite_heads
        return statistics.median(finite) if finite else math.nan

    @property
    def head_max(self) -> float:
        return max(self.finite_heads, default=math.nan)

    def to_dict(self) -> dict:
        return {
            "kappa": _finite(self.kappa),
            "head_kappa": {
                "min": _finite(self.head_min),
                "median": _finite(self.head_median),
                "max": _finite(self.head_max),
            },
            "spectral_norm": _finite(self.norm),
            "heads": [_finite(k) for k in self.head_kappas],
            "nonfinite_heads": list(self.nonfinite_heads),
        }


@dataclass(frozen=True)
class ProjectionRow:
    """One projection in a report: where it is, its spectra, and what a reinit changed (or, in a dry run, would).

    The engine makes one per projection it measured; a dry run, one per planned change (no spectra)."""

    block: AttentionBlock
    role: Role
    before: Spectrum | None
    after: Spectrum | None = None
    heads_changed: tuple[int, ...] = ()
    dtype: str = ""
    bias_zeroed: bool = False
    strength: float | None = None  # the t it was changed at, where a strength was given
    step: int | None = None  # the recipe step that changed it (from 0), in a recipe's report

    def to_dict(self) -> dict:
        proj = self.block.projection(self.role)
        out = {
            "module": self.block.module,
            "stack": self.block.stack,
            "layer": self.block.layer,
            "kind": self.block.kind,
            "role": self.role,
            "tensor": proj.weight.tensor,
            "bias": proj.bias.tensor if proj.bias else None,
            "heads": proj.heads,
            "head_dim": proj.head_dim,
            "in_features": proj.in_features,
            "dtype": self.dtype,
            "before": self.before.to_dict() if self.before else None,
        }
        stream = split_module(self.block.module)[1]
        if stream:  # a joint block's second stream: its projections, reported as that block's
            out["stream"] = stream
        if self.after is not None:
            out["after"] = self.after.to_dict()
        if self.after is not None or self.heads_changed:  # a dry run: what the real run would change
            out["heads_changed"] = list(self.heads_changed)
            out["bias_zeroed"] = self.bias_zeroed
        if self.strength is not None:
            out["strength"] = self.strength
        if self.step is not None:
            out["step"] = self.step
        return out


def _finite(x: float | None) -> float | str | None:
    # JSON has no infinity or NaN: a singular matrix is "inf", a matrix holding NaN/Inf is "nan".
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else "inf"
