"""Init modes: one object per mode, in one registry.

A mode says everything the rest of surgeon needs to know about it: its help, whether it draws fresh
values or reads the old ones, the parameters of its own (``gain``, ``strength``, ``std``: declared and checked by it), the
defaults it takes from the model's config, the extra tensors it writes (W_O), how it draws new heads,
how ``surgeon verify`` checks it, where it is supported, and how it describes itself to the report,
the model card and the record. Plan, engine, verify, report, card and the sharded path ask the mode;
none of them compares mode names.

To add a mode: a module here with a :class:`Mode` subclass (``class X(Mode, name="x")``, its ``parameters``), one line in ``_REGISTRY``;
``tests/compute/test_modes.py`` fails while a slot is left empty. A parameter is declared there and nowhere else:
its option field, flag, help, record row, card row and docs row are made from the declaration
(``tests/compute/test_mode_parameters.py`` adds a mode with a parameter of its own on a copy of the package).

Torch-free at import: planning and the CLI import this package.
"""

from __future__ import annotations

from .base import CONDITIONED_BIBTEX, CONDITIONED_PAPER, Mode, Parameter
from .conditioned import Conditioned
from .mimetic import Mimetic
from .polar import Polar
from .redraw import Redraw
from .restore import Restore

__all__ = [
    "CONDITIONED_BIBTEX",
    "CONDITIONED_PAPER",
    "Mode",
    "NAMES",
    "Parameter",
    "all_modes",
    "get_mode",
    "owner_of",
    "parameter",
    "parameter_docs",
    "parameters",
]

_REGISTRY: dict[str, Mode] = {m.name: m for m in (Conditioned(), Polar(), Redraw(), Mimetic(), Restore())}
NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_mode(name: str) -> Mode:
    """The mode called ``name`` (KeyError for an unknown name: ReinitOptions.validated says it in words)."""
    return _REGISTRY[name]


def all_modes() -> list[Mode]:
    return list(_REGISTRY.values())


def owner_of(name: str) -> Mode | None:
    """The mode that declares the parameter ``name`` (gain, strength, std), if one does."""
    return next((m for m in _REGISTRY.values() if any(p.name == name for p in m.parameters)), None)


def parameters() -> list[Parameter]:
    """Every mode's own parameters, in registry order (each is a field of surgeon.options.ReinitOptions)."""
    return [p for m in _REGISTRY.values() for p in m.parameters]


def parameter(name: str) -> Parameter:
    """The parameter ``name`` as the mode that owns it declares it (KeyError: no mode has one of that name)."""
    found = next((p for p in parameters() if p.name == name), None)
    if found is None:
        raise KeyError(name)
    return found


def parameter_docs() -> str:
    """The Markdown table of every mode's own parameters, made from their declarations (docs/modes.md holds it)."""
    from ..errors import shell_spelling

    rows = [
        f"| `{shell_spelling(p.name, p.metavar or p.kind.__name__.upper())}` | `{p.name}=` | `{m.name}` | {p.help} |"
        for m in _REGISTRY.values()
        for p in m.parameters
    ]
    return "\n".join(["| flag | Python keyword | mode | meaning |", "| --- | --- | --- | --- |", *rows])
