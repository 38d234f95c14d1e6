"""Init modes: one object per mode, in one registry.

A mode says everything the rest of surgeon needs to know about it: its help, whether it draws fresh
values or reads the old ones, the one option of its own (``gain``, ``strength``, ``std``), the
defaults it takes from the model's config, the extra tensors it writes (W_O), how it draws new heads,
how ``surgeon verify`` checks it, where it is supported, and how it describes itself to the report,
the model card and the record. Plan, engine, verify, report, card and the sharded path ask the mode;
none of them compares mode names.

To add a mode: a module here with a :class:`Mode` subclass (``class X(Mode, name="x", option="y")``), one line in ``_REGISTRY``;
``tests/compute/test_modes.py`` fails while a slot is left empty.

Torch-free at import: planning and the CLI import this package.
"""

from __future__ import annotations

from .base import CONDITIONED_BIBTEX, CONDITIONED_PAPER, Mode
from .conditioned import Conditioned
from .mimetic import Mimetic
from .polar import Polar
from .redraw import Redraw

__all__ = ["CONDITIONED_BIBTEX", "CONDITIONED_PAPER", "Mode", "NAMES", "all_modes", "get_mode", "owner_of"]

_REGISTRY: dict[str, Mode] = {m.name: m for m in (Conditioned(), Polar(), Redraw(), Mimetic())}
NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_mode(name: str) -> Mode:
    """The mode called ``name`` (KeyError for an unknown name: ReinitOptions.validated says it in words)."""
    return _REGISTRY[name]


def all_modes() -> list[Mode]:
    return list(_REGISTRY.values())


def owner_of(option: str) -> Mode | None:
    """The mode that owns ``option`` (gain, strength, std), if one does."""
    return next((m for m in _REGISTRY.values() if m.option == option), None)
