"""Restore from another checkpoint: the selected heads (and their biases) take SOURCE's values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import OptionError, opt
from .base import Mode, Parameter

if TYPE_CHECKING:
    import torch

    from ..vocab.change import OptionsView
    from .base import Draw, Options


class Restore(Mode, name="restore"):
    help = "the selected heads (and their biases) take the values of another checkpoint of the same architecture"
    parameters = (
        Parameter(
            "from_",
            "Restore mode: the checkpoint whose values the selected heads take (SOURCE): a file or folder in any format "
            "surgeon reads, or a Hub id org/name; its tensors must have the names, shapes and dtypes of MODEL's.",
            kind=str,
            metavar="SOURCE",
        ),
        Parameter(
            "from_revision",
            "Restore mode: the branch, tag or commit of a Hub SOURCE (default: its main branch; the record pins "
            "the commit).",
            kind=str,
            metavar="REV",
        ),
    )
    fresh = False  # no draw: SOURCE's values
    reference = True
    method = "restore-from-checkpoint"
    label = "Restore from checkpoint"
    verify_bound = "re-derived byte for byte from SOURCE"
    sharded = False
    strength_help = "each selected head becomes (1 - t) * current + t * SOURCE's (default 1: SOURCE's bytes)"

    def check(self, options: OptionsView) -> None:
        super().check(options)
        if options.from_ is None:
            raise OptionError(
                f"{opt('mode', self.name)} takes the values of another checkpoint: name it with {opt('from_')}"
            )
        if options.keep_scale:
            raise OptionError(
                f"{opt('keep_scale', True)} would rescale SOURCE's heads to the current norms: restore copies them "
                f"as they are (use {opt('strength')} to move part of the way)"
            )

    def source(self, options: OptionsView) -> tuple[str, str | None] | None:
        return options.from_, options.from_revision

    def with_reference(self, options: Options, label: str, revision: str | None) -> Options:
        return replace(options, from_=label, from_revision=revision)

    def reads_old(self, options: OptionsView) -> bool:
        return options.strength is not None  # a mix; t = 1 copies SOURCE's bytes

    @property
    def default_bias(self) -> str:
        return "source"

    def draw(self, job: Draw) -> torch.Tensor:
        assert job.reference is not None  # the engine reads SOURCE's heads for a mode with a reference
        return job.reference

    def summary(self, options: dict, blocks: Sequence) -> str:
        return f"restore from {_named(options).replace('`', '')}"

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return f"by restoring them from {_named(options)}"

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return f"restore: the selected heads take the values of {_named(options)}"

    def card_caveat(self) -> str:
        return (
            "The restored projections hold the values of another checkpoint (SOURCE, named in the record): the model "
            "now mixes what two checkpoints learned; evaluate it before relying on it."
        )


def _named(options: dict[str, Any]) -> str:
    revision = options.get("from_revision")
    return f"`{options.get('from_')}`" + (f" at `{revision}`" if revision else "")
