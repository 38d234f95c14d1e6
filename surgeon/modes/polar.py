"""Polar conditioning of the existing weights: singular vectors kept, singular values moved toward 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import CONDITIONED_BIBTEX, CONDITIONED_PAPER, Mode, Parameter

if TYPE_CHECKING:
    import torch

    from .base import Draw


class Polar(Mode, name="polar"):
    help = "condition the existing weights (keep each head's singular vectors, move its singular values to 1)"
    parameters = (
        Parameter(
            "strength",
            "Polar mode: sigma -> sigma^(1-t) for t in (0, 1] (kappa -> kappa^(1-t)). Default 1.",
            default=1.0,
            high=1.0,
            always_recorded=True,
            elsewhere=" (the conditioned reset always reaches kappa = 1)",
            metavar="T",
        ),
    )
    fresh = False
    method = "polar-conditioning"
    label = "Polar conditioning"
    exact = False
    verify_bound = "semi-orthogonal/polar within the dtype's rounding (1 ulp)"
    citation = CONDITIONED_BIBTEX

    def draw(self, job: Draw) -> torch.Tensor:
        from .conditioning import polar

        assert job.old is not None  # not fresh: the engine passes the old values
        return polar(job.old, job.options.effective_strength)

    def summary(self, options: dict, blocks: Sequence) -> str:
        return f"polar, strength {options.get('strength')}"

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return (
            f"by polar conditioning of the existing weights (strength {options.get('strength')}): each head keeps its "
            f"singular vectors and its singular values move toward 1, the condition of {CONDITIONED_PAPER}"
        )

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return (
            f"polar, strength {options.get('strength')}: each head's singular values sigma -> sigma^(1 - strength), "
            "singular vectors kept"
        )

    def card_caveat(self) -> str:
        return (
            "The conditioned projections keep their singular vectors (the directions the source model learned) but "
            "not their singular values: evaluate or fine-tune before relying on them."
        )
