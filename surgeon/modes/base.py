"""The Mode interface every init mode fills (see surgeon/modes/__init__.py for the registry)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import OptionError, opt

if TYPE_CHECKING:
    import torch

    from ..vocab.change import Change, OptionsView, PlanView

CONDITIONED_PAPER = "[Saratchandran & Lucey](https://openreview.net/forum?id=cKNOCYPo2W)"
CONDITIONED_BIBTEX = """\
@inproceedings{saratchandran2026conditioned,
  title     = {Conditioned Initialization for Attention},
  author    = {Saratchandran, Hemanth and Lucey, Simon},
  booktitle = {Submitted to The Fourteenth International Conference on Learning Representations (ICLR)},
  year      = {2026},
  url       = {https://openreview.net/forum?id=cKNOCYPo2W}
}"""


Options = TypeVar("Options", bound="OptionsView")


@dataclass(frozen=True)
class Draw:
    """What one draw is for: a projection's chosen heads, with what the mode may read."""

    change: Change
    old: torch.Tensor | None  # the heads' current values where the mode reads them (Mode.reads_old), else None
    options: OptionsView
    key: str  # the name the draws are keyed by: the tensor's checkpoint name
    device: torch.device | str
    dtype: torch.dtype | None = None  # how the heads are stored, where ``old`` was read (a mix rounds the draw to it)
    reference: torch.Tensor | None = None  # the same heads in SOURCE (float64), for a mode that reads one

    @property
    def strength(self) -> float | None:
        """t for these heads (None: not given, the mode's full effect)."""
        return self.change.strength


STRENGTH_SPELLING = "t in (0, 1], or A:B ramped linearly over the selected layers of each stack"


@dataclass(frozen=True)
class Strength:
    """``--strength``: one t for every selected layer, or ``A:B``: A at the first selected layer of each stack, B at
    its last, linear in between (a stack with one selected layer takes B). Every value lies in (0, 1]: t = 0 would
    change nothing. Read once, when the options are made, and kept read."""

    start: float
    end: float
    ramp: bool = False  # given as A:B (recorded so, even where A == B)

    def recorded(self) -> float | str:
        """As the record, the report and the reproduce command hold it: a number, or ``"A:B"``."""
        return f"{self.start!r}:{self.end!r}" if self.ramp else self.end

    def at(self, index: int, count: int) -> float:
        """The value at the ``index``-th of ``count`` selected layers (exactly A at the first, B at the last)."""
        if count <= 1:
            return self.end
        f = index / (count - 1)
        return (1.0 - f) * self.start + f * self.end

    def per_layer(self, blocks: Sequence[Any]) -> dict[tuple[str, int], float]:
        """(stack, layer) -> t for the layers of ``blocks`` (the re-initialized ones), each stack ramped on its own."""
        layers: dict[str, list[int]] = {}
        for block in blocks:
            layers.setdefault(block.stack, []).append(block.layer)
        out = {}
        for stack, found in layers.items():
            ordered = sorted(set(found))
            out.update({(stack, layer): self.at(i, len(ordered)) for i, layer in enumerate(ordered)})
        return out

    @property
    def full(self) -> bool:
        """t = 1 everywhere: the mode's full effect, the same as not giving it."""
        return self.start == self.end == 1.0


def parse_strength(value: Any) -> Strength | None:
    """``strength`` as given (a number, ``"t"``, ``"A:B"``, a pair, a Strength, or None) read and checked.

    Raises:
        OptionError: It cannot be read, or a value lies outside (0, 1] (t = 0 changes nothing).
    """
    if value is None or isinstance(value, Strength):
        return value
    ramp = isinstance(value, (tuple, list)) or (isinstance(value, str) and ":" in value)
    if isinstance(value, str):
        parts: list[Any] = value.split(":") if ramp else [value]
    elif ramp:
        parts = list(value)
    else:
        parts = [value]
    if len(parts) != (2 if ramp else 1):
        raise OptionError(f"cannot read {opt('strength', value)}: give {STRENGTH_SPELLING}")
    numbers = []
    for part in parts:
        try:
            number = float(part.strip()) if isinstance(part, str) else part
        except ValueError:
            raise OptionError(f"cannot read {opt('strength', value)}: give {STRENGTH_SPELLING}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise OptionError(f"cannot read {opt('strength', value)}: give {STRENGTH_SPELLING}")
        if number == 0:
            raise OptionError(
                f"{opt('strength', value)} changes nothing (t = 0 leaves every head as it is): give t in (0, 1]"
            )
        if not 0 < number <= 1:
            raise OptionError(f"{opt('strength')} must be in (0, 1], not {value}")
        numbers.append(float(number))
    return Strength(numbers[0], numbers[-1], ramp)


def mixed(old: torch.Tensor | None, new: torch.Tensor, t: float | None, dtype: torch.dtype | None) -> torch.Tensor:
    """``(1 - t) * old + t * new`` in float64, ``new`` first rounded to the stored ``dtype`` (so that the mix is
    the one of the weights and of a t = 1 output, as stored); t None or 1: ``new`` itself, untouched."""
    if t is None or t == 1.0:
        return new
    import torch

    assert old is not None  # Mode.reads_old: a mix reads the old values
    fresh = new.to(dtype).to(torch.float64) if dtype is not None else new
    return (1.0 - t) * old + t * fresh.to(old.device)


@dataclass(frozen=True)
class Parameter:
    """A setting only one mode takes, declared by that mode (``Mode.parameters``) and checked by it: the one place
    it is spelt.

    Everything else is made from it: its ``surgeon.options.ReinitOptions`` field (``name``, default None), the Python
    keyword and the command-line flag (``--name``, dashes for underscores, a trailing underscore dropped: ``from_``
    is ``--from``), its ``--help`` line, the record's row (read back and checked by surgeon.report.record), its row
    in the model card and in docs/modes.md. Options given it for another mode are refused, naming its mode.
    """

    name: str
    help: str  # for --help, the card's and the docs' tables
    kind: type = float  # float: a number; str: a word or a name (a path, a Hub id)
    default: float | str | None = None  # the value used where not given (None: the mode decides, or none)
    high: float | None = None  # numbers lie in (0, high] (None: any finite number above 0)
    always_recorded: bool = False  # the record lists it resolved for its mode and None for the others (else: where set)
    elsewhere: str = ""  # added to the error that refuses it for another mode
    metavar: str | None = None  # what --help shows after the flag (default: the kind's)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` (given: not None) is refused, or None."""
        if self.kind is str:
            if not isinstance(value, str) or not value.strip() or not value.isprintable() or len(value) > 4096:
                return f"{opt(self.name)} must be a name on one line, not {value!r}"
            return None
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if self.high is not None:
            if number and 0.0 < float(value) <= self.high:
                return None
            return f"{opt(self.name)} must be in (0, {self.high:g}], not {value}"
        if not number or not math.isfinite(value) or value <= 0:
            return f"{opt(self.name)} must be a finite number above 0, not {value!r}"
        return None

    def resolved(self, value: Any) -> float | str | None:
        """``value`` as used: the default where not given."""
        if value is None:
            return self.default
        return str(value) if self.kind is str else float(value)

    @property
    def label(self) -> str:
        """How the model card's options table names it."""
        return self.name.strip("_").replace("_", " ")


@dataclass(frozen=True)
class Mode:
    """One way of re-initializing the chosen heads: ``class X(Mode, name="x")`` (its --mode value), a frozen
    dataclass. Subclasses fill every slot without a default here (tests/compute/test_modes.py); the defaults are
    what most modes are: fresh, exact, sharded, with no parameters of their own."""

    name: ClassVar[str]
    help: ClassVar[str]  # one sentence for --help and the "unknown mode" error
    method: ClassVar[str]  # the record's "method": what was done, by name
    label: ClassVar[str]  # what was done, as a Hub commit message starts ("Conditioned re-initialization")
    fresh: ClassVar[bool] = True  # draws new values without reading the old ones: biases are zeroed by default
    parameters: ClassVar[tuple[Parameter, ...]] = ()  # the numbers only this mode takes (ReinitOptions fields)
    exact: ClassVar[bool] = True  # verify re-derives the bytes exactly (else within verify_bound)
    verify_bound: ClassVar[str] = "re-derived byte for byte from the seed"  # how verify checks it, in words
    writes_outputs: ClassVar[bool] = False  # also rewrites each block's output projection W_O (find_outputs)
    sharded: ClassVar[bool] = True  # supported on sharded (FSDP2 / DTensor) parameters
    citation: ClassVar[str | None] = None  # BibTeX for the card, None: nothing to cite
    # reads the heads of another checkpoint, SOURCE (Mode.source names it): the engine hands them to draw
    reference: ClassVar[bool] = False
    # --strength t: each selected head becomes (1 - t) * old + t * new (else the mode reads t itself: polar)
    mixes: ClassVar[bool] = True
    strength_help: ClassVar[str] = "each selected head becomes (1 - t) * old + t * new (default 1: the new heads)"

    def __init_subclass__(cls, *, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        dataclass(frozen=True)(cls)  # frozen too: a subclass not made a dataclass itself would take attributes

    @property
    def tag(self) -> str:
        """The model card's Hub tag: the method's name."""
        return self.method

    def check(self, options: OptionsView) -> None:
        """Refuse ``options`` where this mode's parameters are out of range (or clash with the other options).

        Raises:
            OptionError: A parameter is out of range.
        """
        for parameter in self.parameters:
            value = getattr(options, parameter.name)
            why = None if value is None else parameter.problem(value)
            if why:
                raise OptionError(why)

    def draw(self, job: Draw) -> torch.Tensor:
        """New per-head matrices ``(len(job.change.heads), d, in)`` (float64), PyTorch (out, in) orientation."""
        raise NotImplementedError

    def source(self, options: OptionsView) -> tuple[str, str | None] | None:
        """The checkpoint a mode with a ``reference`` reads (a path or a Hub id, and a Hub revision), else None."""
        return None

    def with_reference(self, options: Options, label: str, revision: str | None) -> Options:
        """``options`` naming SOURCE as published (a Hub id and its commit, or a file or folder's name: no path)."""
        return options

    def reads_old(self, options: OptionsView) -> bool:
        """Whether the heads' old values are read (a mode that is not fresh, or a mix at t < 1)."""
        return not self.fresh or (self.mixes and options.strength is not None)

    def heads(self, job: Draw) -> torch.Tensor:
        """The heads' new values at the job's strength: the draw, mixed with the old values where the mode mixes
        (``(1 - t) * old + t * new``; t = 1 is the draw itself, byte for byte)."""
        new = self.draw(job)
        return mixed(job.old, new, job.strength, job.dtype) if self.mixes else new

    @property
    def default_bias(self) -> str:
        """What ``bias="auto"`` does to the selected heads' biases: "zero" (a fresh start), "keep", or "source"
        (SOURCE's, for a mode with a ``reference``)."""
        return "zero" if self.fresh else "keep"

    def with_defaults(self, options: Options, config: Any) -> Options:
        """``options`` with what this mode takes from the model's config filled in."""
        return options

    def find_outputs(self, plan: PlanView, shapes: dict) -> dict[str, tuple[str, bool]]:
        """The tensors this mode writes besides Q/K/V, found among ``shapes`` (tensor -> shape), or refuse:
        ``plan.outputs``, block module -> (its W_O tensor, stored as nn.Linear). Most modes write none."""
        return {}

    def draw_output(self, change: Change, options: OptionsView, *, key: str, linear: bool) -> torch.Tensor:
        """The whole new value (float64, as stored) of the output tensor ``find_outputs`` found for the block
        of ``change`` (its value projection); ``key``: the name the value projection's draws are keyed by."""
        raise NotImplementedError(f"{self.name} writes no output projections")

    def summary(self, options: dict, blocks: Sequence) -> str:
        """The report's one-line description (``options``: as recorded)."""
        raise NotImplementedError

    def legend(self, options: dict) -> str:
        """What the report's reader should know about the condition numbers this mode leaves ('' for nothing)."""
        return ""

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        """Completes "... re-initialized by surgeon X " in the model card: what was done to ``blocks``, in words."""
        raise NotImplementedError

    def card_row(self, options: dict, blocks: Sequence) -> str:
        """The "mode" row of the card's options table (``blocks``: the re-initialized ones)."""
        raise NotImplementedError

    def card_caveat(self) -> str:
        """What the re-initialized projections still hold of the source model."""
        return (
            "The re-initialized projections no longer hold what the source model learned there: this is a starting "
            "point for fine-tuning or further training, not a drop-in replacement for the source."
        )
