"""The paper's conditioned reset: semi-orthogonal query/key heads, rectangular-identity values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import OptionError, opt
from .base import CONDITIONED_BIBTEX, CONDITIONED_PAPER, Mode, Parameter

if TYPE_CHECKING:
    import torch

    from ..vocab.change import OptionsView
    from .base import Draw


class Conditioned(Mode, name="conditioned"):
    help = "the paper's fresh reset (semi-orthogonal q/k heads, value = rectangular identity; every head kappa 1)"
    parameters = (
        Parameter(
            "gain",
            "Conditioned mode: scale of the semi-orthogonal q/k heads (default 1; 0.02 * sqrt(width) matches a "
            "normal(0, 0.02) init's scale).",
            metavar="G",
        ),
    )
    method = "conditioned-initialization"
    label = "Conditioned re-initialization"
    citation = CONDITIONED_BIBTEX

    def check(self, options: OptionsView) -> None:
        super().check(options)
        if options.gain is not None and options.keep_scale:
            raise OptionError(
                f"{opt('gain')} and {opt('keep_scale', True)} both set the scale of the new heads: use one of them"
            )

    def draw(self, job: Draw) -> torch.Tensor:
        import torch

        from .conditioning import head_seed, semi_orthogonal_batch, value_identity

        change, options = job.change, job.options
        d, n_in = change.projection.head_dim, change.projection.in_features
        if change.role == "v":
            return torch.stack(
                [value_identity(h, d, n_in, options.value_identity, device=job.device) for h in change.heads]
            )
        seeds = [head_seed(options.seed, job.key, change.role, h) for h in change.heads]
        new = semi_orthogonal_batch(d, n_in, seeds, device=job.device)
        if options.gain is not None and options.gain != 1:
            new = new * float(options.gain)
        return new

    def summary(self, options: dict, blocks: Sequence) -> str:
        gain = f", q/k gain {options['gain']}" if options.get("gain") is not None else ""
        return f"conditioned, value identity {options.get('value_identity')}{gain}"

    def legend(self, options: dict) -> str:
        return "q/k heads are drawn independently (the paper's way), so a whole q/k keeps kappa > 1" + (
            "; block value identity: kappa 1 as a whole." if options.get("value_identity") == "block" else "."
        )

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return f"with conditioned initialization ({CONDITIONED_PAPER})"

    def card_row(self, options: dict, blocks: Sequence) -> str:
        gain = f"; q/k gain {options['gain']}" if options.get("gain") is not None else ""
        return (
            "conditioned: independent semi-orthogonal query and key per head, value = rectangular identity "
            f"({options.get('value_identity')}){gain}"
        )
