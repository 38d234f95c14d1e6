"""The options of a re-initialization: :class:`ReinitOptions`, their checks, and how a shell spells them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .errors import OptionError, opt
from .modes import NAMES as MODES
from .modes import all_modes, get_mode, owner_of
from .vocab.selection import IndexSpec, parse_targets
from .vocab.spectrum import VALUE_IDENTITIES

BIAS_CHOICES = ("auto", "zero", "keep")


AS_FIELD = "(the field's default)"  # OptionInfo.shell_default when a shell shows the field's own default


@dataclass(frozen=True)
class OptionInfo:
    """What a user-facing shell needs to know about one option of :class:`ReinitOptions`.

    The CLI makes its ``--flags`` from these (surgeon.cli.commands), the model card its reproduce command
    (surgeon.report.card): the options are spelt once, as the fields of ReinitOptions.
    """

    help: str
    choices: tuple[str, ...] | None = None  # the values a shell offers (None: any)
    kind: type | None = None  # int / float where the value is a number
    switch: bool = False  # a bool field: given or not (--keep-scale)
    shell_default: Any = AS_FIELD  # the default a shell shows, where it differs from the field's
    spec: bool = False  # an index spec (may start with "-": a command line writes --layers=SPEC)
    # recorded options -> whether a reproduce command needs it (an option recorded as None never is)
    recorded: Callable[[dict], bool] | None = None


def _option(default: Any, help: str, **info: Any) -> Any:
    return field(default=default, metadata={"shell": OptionInfo(help, **info)})


def option_infos() -> list[tuple[str, OptionInfo]]:
    """(field name, OptionInfo) of every option, in field order."""
    return [(f.name, f.metadata["shell"]) for f in fields(ReinitOptions)]


@dataclass(frozen=True)
class ReinitOptions:
    """How to re-initialize; the defaults are the paper's conditioned reset of every layer.

    The one spelling of the options: every entry point (``reinit_checkpoint``, ``reinit_``,
    ``conditioned_init_``, the Trainer callback, the ranks of a distributed run) takes a ReinitOptions as
    ``options=`` and its fields as keywords (:meth:`build`); the CLI's flags and the model card's reproduce
    command are made from its fields. Each field's meaning is its help (``surgeon reinit --help``).

    Attributes:
        layers: Layers per stack: a spec (``"all"``, ``"0-11"``, ``"-2-"``, ``"0,3,5-7"``) or ints.
        targets: Projections: any of q, k, v (``"q,k"`` or an iterable).
        heads: Query heads, as a spec or ints (K/V: the key/value heads they use).
        attention: ``"self"``, ``"cross"`` or ``"all"``.
        stack: Only the stacks whose path or name part is given (None: all).
        mode: ``conditioned``, ``polar``, ``redraw`` or ``mimetic``.
        strength: Polar mode's t in (0, 1] (None: 1).
        value_identity: ``"block"`` or ``"per-head"`` value identity.
        keep_scale: Rescale each new head to the old one's Frobenius norm.
        bias: ``"auto"``, ``"zero"`` or ``"keep"`` for the re-initialized heads' biases.
        seed: The draws' seed.
        gain: Conditioned mode's scale of the q/k heads (None: 1).
        std: Redraw mode's std (None: from config.json).
    """

    layers: IndexSpec = _option("all", "Layers to re-initialize, per stack.", spec=True)
    targets: str | Iterable[str] = _option(
        ("q", "k", "v"), "Projections to re-initialize: any of q,k,v.", shell_default="q,k,v"
    )
    heads: IndexSpec = _option("all", "Query heads to re-initialize (K/V: the key/value heads they use).", spec=True)
    attention: str = _option("all", "Self-attention, cross-attention or both.", choices=("self", "cross", "all"))
    stack: str | Iterable[str] | None = _option(
        None, "Only these stacks, by path or name part (e.g. encoder, decoder); comma-separated."
    )
    mode: str = _option("conditioned", " ".join(f"{m.name}: {m.help}." for m in all_modes()), choices=MODES)
    strength: float | None = _option(
        None,
        "Polar mode: sigma -> sigma^(1-t) for t in (0, 1] (kappa -> kappa^(1-t)). Default 1.",
        kind=float,
    )
    value_identity: str = _option(
        "block",
        "block: the whole value projection is the rectangular identity; per-head: every head is I.",
        choices=("block", "per-head"),
        recorded=lambda o: get_mode(o["mode"]).fresh,
    )
    keep_scale: bool = _option(False, "Rescale each new head matrix to the original's Frobenius norm.", switch=True)
    bias: str = _option(
        "auto",
        "Biases of re-initialized heads. Default: zero for the fresh modes ("
        + ", ".join(m.name for m in all_modes() if m.fresh)
        + "), keep for "
        + ", ".join(m.name for m in all_modes() if not m.fresh)
        + ".",
        choices=("zero", "keep"),
        shell_default=None,
    )
    seed: int = _option(
        0, "Random seed; each head's draw depends only on (seed, the tensor's name in the base model, head).", kind=int
    )
    gain: float | None = _option(
        None,
        "Conditioned mode: scale of the semi-orthogonal q/k heads (default 1; 0.02 * sqrt(width) matches a "
        "normal(0, 0.02) init's scale).",
        kind=float,
    )
    std: float | None = _option(
        None,
        "Redraw mode: std of the normal draws (default: config.json's initializer_range, else 0.02; "
        "nn.MultiheadAttention tensors use xavier_uniform).",
        kind=float,
    )

    @classmethod
    def build(cls, options: ReinitOptions | None = None, /, **keywords: Any) -> ReinitOptions:
        """``options`` with the fields given as keywords replaced (unchecked: see :meth:`validated`).

        Args:
            options: The options to start from (default: the defaults).
            **keywords: Fields of ReinitOptions.

        Returns:
            A new ReinitOptions.

        Raises:
            TypeError: A keyword is not a field, or ``options`` is not a ReinitOptions.
        """
        names = {f.name for f in fields(cls)}
        for key in keywords:
            if key not in names:
                raise TypeError(f"unexpected keyword argument {key!r}; the options are {', '.join(sorted(names))}")
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a surgeon.ReinitOptions, not {type(options).__name__}")
        return replace(options if options is not None else cls(), **keywords)

    def validated(self) -> ReinitOptions:
        """Check the values against each other (the selection is checked against a model when planning).

        Returns:
            These options.

        Raises:
            OptionError: A value is unknown or out of range, or applies to another mode.
        """
        if self.mode not in MODES:
            raise OptionError(
                f"unknown mode {self.mode!r}: use " + "; ".join(f"{m.name} ({m.help})" for m in all_modes())
            )
        for name, value in (("gain", self.gain), ("std", self.std)):
            if value is None:
                continue
            owner = owner_of(name)
            if owner is not None and self.mode != owner.name:
                raise OptionError(f"{opt(name)} applies to {opt('mode', owner.name)} only")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise OptionError(f"{opt(name)} must be a finite number above 0, not {value!r}")
        if self.gain is not None and self.keep_scale:
            raise OptionError(
                f"{opt('gain')} and {opt('keep_scale', True)} both set the scale of the new heads: use one of them"
            )
        if self.strength is not None:
            if get_mode(self.mode).option != "strength":
                owner = owner_of("strength")
                raise OptionError(
                    f"{opt('strength')} applies to {opt('mode', owner.name if owner else None)} only (the conditioned reset always reaches kappa = 1)"
                )
            if not 0.0 < float(self.strength) <= 1.0:
                raise OptionError(f"{opt('strength')} must be in (0, 1], not {self.strength}")
        if self.value_identity not in VALUE_IDENTITIES:
            raise OptionError(f"unknown value identity {self.value_identity!r}: use block or per-head")
        if self.bias not in BIAS_CHOICES:
            raise OptionError(f"unknown bias policy {self.bias!r}: use zero, keep or auto")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise OptionError(f"seed must be an integer, not {self.seed!r}")
        return self

    @property
    def effective_strength(self) -> float:
        """The polar strength used: ``strength``, or 1 when not given."""
        return 1.0 if self.strength is None else float(self.strength)

    @property
    def zero_bias(self) -> bool:
        """Whether the re-initialized heads' biases are zeroed (``bias="auto"``: for the fresh modes)."""
        # A fresh reset starts from zero biases; conditioning pretrained weights keeps them.
        return self.bias == "zero" or (self.bias == "auto" and get_mode(self.mode).fresh)

    def to_dict(self) -> dict:
        """The options as recorded in reports, records and cards.

        Returns:
            A JSON-ready dict: specs as given, targets and stacks as lists, the strength and the bias policy
            resolved, ``gain`` and ``std`` only where set.
        """
        out = asdict(self)
        for key in ("layers", "heads"):
            value = out[key]
            out[key] = value if value is None or isinstance(value, (str, int)) else list(value)
        out["targets"] = list(parse_targets(self.targets))
        out["stack"] = None if self.stack is None else stacks_of(self.stack)
        out["strength"] = self.effective_strength if get_mode(self.mode).option == "strength" else None
        out["bias"] = "zero" if self.zero_bias else "keep"
        for key in ("gain", "std"):  # only where set: records of the other modes stay as they were
            if out[key] is None:
                del out[key]
        return out


def stacks_of(spec: str | Iterable[str]) -> list[str]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return [s.strip() for s in items if s.strip()]
