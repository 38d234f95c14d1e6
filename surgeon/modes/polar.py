"""Polar conditioning of the existing weights: singular vectors kept, singular values moved toward 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import CONDITIONED_BIBTEX, CONDITIONED_PAPER, Mode

if TYPE_CHECKING:
    import torch

    from .base import Draw


class Polar(Mode, name="polar"):
    help = "condition the existing weights (keep each head's singular vectors, move its singular values to 1)"
    mixes = False  # --strength is polar's own: how far the singular values move
    strength_help = "sigma -> sigma^(1-t), so kappa -> kappa^(1-t) (default 1: the nearest semi-orthogonal matrix)"
    fresh = False
    method = "polar-conditioning"
    label = "Polar conditioning"
    exact = False
    verify_bound = "semi-orthogonal/polar within the dtype's rounding (1 ulp)"
    citation = CONDITIONED_BIBTEX

    def draw(self, job: Draw) -> torch.Tensor:
        from .conditioning import polar

        assert job.old is not None  # not fresh: the engine passes the old values
        return polar(job.old, 1.0 if job.strength is None else job.strength)

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
