"""Init modes: one object per mode, in one registry.

A mode says everything the rest of surgeon needs to know about it: its help, whether it draws fresh
values or reads the old ones, the one option of its own (``gain``, ``strength``, ``std``), the
defaults it takes from the model's config, the extra tensors it writes (W_O), how it draws new heads,
how ``surgeon verify`` checks it, where it is supported, and how it describes itself to the report,
the model card and the record. Plan, engine, verify, report, card and the sharded path ask the mode;
none of them compares mode names.

To add a mode: a module here with a :class:`Mode` subclass, one line in ``_REGISTRY``;
``tests/test_modes.py`` fails while a slot is left empty.

Torch-free at import: planning and the CLI import this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ..plan import Change, ReinitOptions

CONDITIONED_PAPER = "[Saratchandran & Lucey](https://openreview.net/forum?id=cKNOCYPo2W)"
CONDITIONED_BIBTEX = """\
@inproceedings{saratchandran2026conditioned,
  title     = {Conditioned Initialization for Attention},
  author    = {Saratchandran, Hemanth and Lucey, Simon},
  booktitle = {Submitted to The Fourteenth International Conference on Learning Representations (ICLR)},
  year      = {2026},
  url       = {https://openreview.net/forum?id=cKNOCYPo2W}
}"""


@dataclass(frozen=True)
class Mode:
    """One way of re-initializing the chosen heads. Subclasses fill every slot (tests/test_modes.py)."""

    name: ClassVar[str]
    help: ClassVar[str]  # one sentence for --help and the "unknown mode" error
    fresh: ClassVar[bool]  # draws new values without reading the old ones: biases are zeroed by default
    option: ClassVar[str | None]  # the ReinitOptions field only this mode takes (None: none)
    method: ClassVar[str]  # the record's "method": what was done, by name
    label: ClassVar[str]  # what was done, as a Hub commit message starts ("Conditioned re-initialization")
    tag: ClassVar[str]  # the model card's Hub tag
    exact: ClassVar[bool]  # verify re-derives the bytes exactly (else within verify_bound)
    verify_bound: ClassVar[str]  # how verify checks it, in words (for its report and the README)
    writes_outputs: ClassVar[bool]  # also rewrites each block's output projection W_O
    onnx: ClassVar[bool]  # supported on ONNX graphs
    sharded: ClassVar[bool]  # supported on sharded (FSDP2 / DTensor) parameters
    citation: ClassVar[str | None]  # BibTeX for the card, None: nothing to cite

    def draw(self, change: Change, old: torch.Tensor | None, options: ReinitOptions, *, key: str, device: Any) -> torch.Tensor:
        """New per-head matrices ``(len(change.heads), d, in)`` (float64), PyTorch (out, in) orientation.

        ``old`` holds the heads' current values where the mode reads them (``not fresh``), else None;
        ``key`` names the tensor the draws are keyed by (its checkpoint name).
        """
        raise NotImplementedError

    def with_defaults(self, options: ReinitOptions, config: Any) -> ReinitOptions:
        """``options`` with what this mode takes from the model's config filled in."""
        return options

    def add_outputs(self, plan: Any, shapes: dict) -> None:
        """Add to ``plan.outputs`` the tensors this mode writes besides Q/K/V (found among ``shapes``), or refuse."""

    def summary(self, options: dict, blocks: list) -> str:
        """The report's one-line description (``options``: as recorded)."""
        raise NotImplementedError

    def legend(self, options: dict) -> str:
        """What the report's reader should know about the condition numbers this mode leaves ('' for nothing)."""
        return ""

    def card_intro(self, options: dict) -> str:
        """Completes "... re-initialized by surgeon X " in the model card: what was done, in words."""
        raise NotImplementedError

    def card_row(self, options: dict) -> str:
        """The "mode" row of the card's options table."""
        raise NotImplementedError

    def card_caveat(self) -> str:
        """What the re-initialized projections still hold of the source model."""
        return (
            "The re-initialized projections no longer hold what the source model learned there: this is a starting "
            "point for fine-tuning or further training, not a drop-in replacement for the source."
        )


def _registry() -> dict[str, Mode]:
    from .conditioned import Conditioned
    from .mimetic import Mimetic
    from .polar import Polar
    from .redraw import Redraw

    return {m.name: m for m in (Conditioned(), Polar(), Redraw(), Mimetic())}


_REGISTRY: dict[str, Mode] = _registry()
NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_mode(name: str) -> Mode:
    """The mode called ``name`` (KeyError for an unknown name: ReinitOptions.validated says it in words)."""
    return _REGISTRY[name]


def all_modes() -> list[Mode]:
    return list(_REGISTRY.values())


def owner_of(option: str) -> Mode | None:
    """The mode that owns ``option`` (gain, strength, std), if one does."""
    return next((m for m in _REGISTRY.values() if m.option == option), None)
