"""The control: the family's own default init, drawn again (see surgeon.modes.baselines for the sources)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .base import Mode, Parameter

if TYPE_CHECKING:
    import torch

    from .base import Draw, Options


class Redraw(Mode, name="redraw"):
    help = "the family's own default init, drawn again (the control)"
    parameters = (
        Parameter(
            "std",
            "Redraw mode: std of the normal draws (default: config.json's initializer_range, else 0.02; "
            "nn.MultiheadAttention tensors use xavier_uniform).",
            metavar="S",
        ),
    )
    method = "default-init-redraw"
    label = "Default-init redraw"

    def draw(self, job: Draw) -> torch.Tensor:
        from .baselines import redraw_heads

        return redraw_heads(job.change, job.key, job.options, device=job.device)

    def with_defaults(self, options: Options, config: Any) -> Options:
        from .baselines import config_std

        return options if options.std is not None else replace(options, std=config_std(config)[0])

    def summary(self, options: dict, blocks: Sequence) -> str:
        return f"redraw, {_draws(options, blocks)}"

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return (
            f"with a fresh draw of the family's own default initialization ({_draws(options, blocks)}). "
            "This is the control of a comparison, not conditioned initialization"
        )

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return f"redraw: the family's default init drawn again, {_draws(options, blocks)}"


def _draws(options: dict, blocks: Sequence) -> str:
    """The draws the blocks get, in words: normal(0, std), and xavier_uniform only where nn.MultiheadAttention
    tensors are among them (that is its own default init)."""
    from .baselines import is_xavier

    kinds = {is_xavier(p.weight.tensor) for b in blocks for p in b.projections}
    normal = f"normal(0, {options.get('std')})"
    xavier = "xavier_uniform for nn.MultiheadAttention tensors"
    if kinds == {True}:
        return xavier
    return f"{normal}; {xavier}" if True in kinds else normal
