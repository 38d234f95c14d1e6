"""The options of a re-initialization: :class:`ReinitOptions`, their checks, and how a shell spells them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from .errors import OptionError, SurgeonError, opt
from .modes import NAMES as MODES
from .modes import all_modes, get_mode, parameters
from .modes.base import STRENGTH_SPELLING, Strength, parse_strength
from .vocab.blocks import Role
from .vocab.selection import TARGETS, IndexSelection, parse_attention, parse_indices, parse_targets
from .vocab.spectrum import VALUE_IDENTITIES

BIAS_CHOICES = ("auto", "zero", "keep", "source")  # source: SOURCE's, for a mode that reads one


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
    metavar: str | None = None  # what --help shows after the flag (None: the kind's)
    # recorded options -> whether a reproduce command needs it (an option recorded as None never is)
    recorded: Callable[[dict], bool] | None = None


def _option(default: Any, help: str, **info: Any) -> Any:
    return field(default=default, metadata={"shell": OptionInfo(help, **info)})


def _with_mode_parameters(cls: type) -> type:
    """``cls`` with one field per mode parameter (surgeon.modes.parameters: each declared by its mode, with its
    help and checks), after the fields written here: a mode's parameter is spelt once, where the mode declares it."""
    for declared in parameters():
        cls.__annotations__[declared.name] = f"{declared.kind.__name__} | None"
        info = OptionInfo(declared.help, kind=declared.kind, metavar=declared.metavar)
        setattr(cls, declared.name, field(default=None, metadata={"shell": info}))
    return cls


def _strength_help() -> str:
    """--strength's help: what t does in each mode, as the modes say it (Mode.strength_help)."""
    meanings: dict[str, list[str]] = {}
    for mode in all_modes():
        meanings.setdefault(mode.strength_help, []).append(mode.name)
    return (
        f"How far the selected heads move: {STRENGTH_SPELLING}. "
        + "; ".join(f"{', '.join(names)}: {meaning}" for meaning, names in meanings.items())
        + "."
    )


def option_infos() -> list[tuple[str, OptionInfo]]:
    """(field name, OptionInfo) of every option, in field order."""
    return [(f.name, f.metadata["shell"]) for f in fields(ReinitOptions)]


@dataclass(frozen=True)
@_with_mode_parameters
class ReinitOptions:
    """How to re-initialize; the defaults are the paper's conditioned reset of every layer.

    The one spelling of the options: every entry point (``reinit_checkpoint``, ``reinit_``,
    ``conditioned_init_``, the Trainer callback, the ranks of a distributed run) takes a ReinitOptions as
    ``options=`` and its fields as keywords (:meth:`build`); the CLI's flags and the model card's reproduce
    command are made from its fields. Each field's meaning is its help (``surgeon reinit --help``).

    A frozen, hashable value, read and checked when made: the selection is kept read (``layers`` and ``heads`` as
    :class:`~surgeon.vocab.selection.IndexSelection`, ``targets`` and ``stack`` as tuples), and a value no model
    can use is refused here, before any checkpoint is opened; what needs the model (a layer past its last, a head
    it does not have) is checked when planning. The modes' own parameters (``gain``, ``std``, ...) are
    declared and checked by their modes (``surgeon.modes.Mode.parameters``): each is a field too, added after
    the ones below, None where not given.

    Attributes:
        layers: Layers per stack: a spec (``"all"``, ``"0-11"``, ``"-2-"``, ``"0,3,5-7"``) or ints, kept read.
        targets: Projections: any of q, k, v (``"q,k"`` or an iterable), kept as a tuple in q, k, v order.
        heads: Query heads, as a spec or ints (K/V: the key/value heads they use), kept read.
        attention: ``"self"``, ``"cross"`` or ``"all"``.
        stack: Only the stacks whose path or name part is given (None: all), kept as a tuple.
        mode: ``conditioned``, ``polar``, ``redraw``, ``mimetic`` (every mode of the registry).
        strength: How far the selected heads move (:class:`~surgeon.modes.base.Strength`, kept read): t in (0, 1]
            (``0.5``, ``"0.5"``) or a per-layer ramp ``"A:B"`` (or ``(A, B)``); None: 1. Where the mode mixes,
            each head becomes ``(1 - t) * old + t * new``; polar: sigma -> sigma^(1-t).
        value_identity: ``"block"`` or ``"per-head"`` value identity.
        keep_scale: Rescale each new head to the old one's Frobenius norm.
        bias: ``"auto"``, ``"zero"``, ``"keep"`` or ``"source"`` (a restore's default) for the re-initialized
            heads' biases.
        seed: The draws' seed.
    """

    layers: IndexSelection = _option(
        parse_indices("all", what="layer"), "Layers to re-initialize, per stack.", spec=True, shell_default="all"
    )
    targets: tuple[Role, ...] = _option(TARGETS, "Projections to re-initialize: any of q,k,v.", shell_default="q,k,v")
    heads: IndexSelection = _option(
        parse_indices("all", what="head"),
        "Query heads to re-initialize (K/V: the key/value heads they use).",
        spec=True,
        shell_default="all",
    )
    attention: str = _option("all", "Self-attention, cross-attention or both.", choices=("self", "cross", "all"))
    stack: tuple[str, ...] | None = _option(
        None, "Only these stacks, by path or name part (e.g. encoder, decoder); comma-separated."
    )
    mode: str = _option("conditioned", " ".join(f"{m.name}: {m.help}." for m in all_modes()), choices=MODES)
    strength: Strength | None = _option(None, _strength_help(), kind=str, metavar="T|A:B")
    value_identity: str = _option(
        "block",
        "block: the whole value projection is the rectangular identity; per-head: every head is I.",
        choices=("block", "per-head"),
        recorded=lambda o: get_mode(o["mode"]).fresh,
    )
    keep_scale: bool = _option(False, "Rescale each new head matrix to the original's Frobenius norm.", switch=True)
    bias: str = _option(
        "auto",
        "Biases of re-initialized heads (source: SOURCE's, mixed as the heads are). Default: "
        + "; ".join(
            f"{policy} for {', '.join(m.name for m in all_modes() if m.default_bias == policy)}"
            for policy in dict.fromkeys(m.default_bias for m in all_modes())
        )
        + ".",
        choices=BIAS_CHOICES[1:],
        shell_default=None,
    )
    seed: int = _option(
        0, "Random seed; each head's draw depends only on (seed, the tensor's name in the base model, head).", kind=int
    )
    # + one field per mode parameter (_with_mode_parameters): gain, std, ...

    if TYPE_CHECKING:  # for type checkers: the mode parameters' fields, added from the registry

        def __getattr__(self, name: str) -> Any: ...

    def __post_init__(self) -> None:
        """Check the values against each other, then read the selection (against a model: when planning).

        Raises:
            OptionError: A value is unknown or out of range, or applies to another mode.
            SelectionError: A layer or head spec, a target or an attention kind cannot be read.
        """
        if self.mode not in MODES:
            raise OptionError(
                f"unknown mode {self.mode!r}: use " + "; ".join(f"{m.name} ({m.help})" for m in all_modes())
            )
        mode = get_mode(self.mode)
        for owner in all_modes():
            for given in owner.parameters:
                if owner is not mode and getattr(self, given.name) is not None:
                    raise OptionError(f"{opt(given.name)} applies to {opt('mode', owner.name)} only{given.elsewhere}")
        strength = parse_strength(self.strength)
        # t = 1 is the mode's full effect, as without it: recorded so, the same bytes in every output
        object.__setattr__(
            self, "strength", None if strength is not None and strength.full and mode.mixes else strength
        )
        mode.check(self)
        if self.value_identity not in VALUE_IDENTITIES:
            raise OptionError(f"unknown value identity {self.value_identity!r}: use block or per-head")
        if self.bias not in BIAS_CHOICES:
            raise OptionError(f"unknown bias policy {self.bias!r}: use zero, keep, source or auto")
        if self.bias == "source" and not mode.reference:
            readers = ", ".join(m.name for m in all_modes() if m.reference)
            raise OptionError(f"{opt('bias', 'source')} takes SOURCE's biases: it goes with {opt('mode', readers)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise OptionError(f"seed must be an integer, not {self.seed!r}")
        parse_attention(self.attention)
        # frozen: the fields are set once, here, to their read form (replace() hands a read form back: kept as it is)
        object.__setattr__(self, "layers", parse_indices(self.layers, what="layer"))
        object.__setattr__(self, "heads", parse_indices(self.heads, what="head"))
        object.__setattr__(self, "targets", parse_targets(self.targets))
        if self.stack is not None:
            object.__setattr__(self, "stack", _stacks(self.stack))

    @classmethod
    def build(cls, options: ReinitOptions | None = None, /, **keywords: Any) -> ReinitOptions:
        """``options`` with the fields given as keywords replaced, checked as any ReinitOptions is when made.

        Args:
            options: The options to start from (default: the defaults).
            **keywords: Fields of ReinitOptions.

        Returns:
            A new ReinitOptions.

        Raises:
            TypeError: A keyword is not a field, or ``options`` is not a ReinitOptions.
            OptionError: A value is unknown or out of range, or applies to another mode.
            SelectionError: A layer or head spec, a target or an attention kind cannot be read.
        """
        names = {f.name for f in fields(cls)}
        for key in keywords:
            if key not in names:
                raise TypeError(f"unexpected keyword argument {key!r}; the options are {', '.join(sorted(names))}")
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a surgeon.ReinitOptions, not {type(options).__name__}")
        return replace(options if options is not None else cls(), **keywords)

    @property
    def zero_bias(self) -> bool:
        """Whether the re-initialized heads' biases are zeroed (``bias="auto"``: for the fresh modes)."""
        return self.bias_policy == "zero"

    @property
    def bias_policy(self) -> str:
        """What happens to the re-initialized heads' biases: "zero", "keep" or "source" (``auto``: the mode's)."""
        # A fresh reset starts from zero biases; conditioning pretrained weights keeps them; a restore takes SOURCE's.
        return self.bias if self.bias != "auto" else get_mode(self.mode).default_bias

    def to_dict(self) -> dict:
        """The options as recorded in reports, records and cards.

        Returns:
            A JSON-ready dict: specs as given, targets and stacks as lists, the bias policy resolved, the strength
            as a number or ``"A:B"`` (None where not given and the mode mixes; polar's default 1 where not given); a
            mode parameter recorded as its ``Parameter`` says (gain and std only where set).
        """
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("layers", "heads"):
            given = out[key].given
            out[key] = given if given is None or isinstance(given, (str, int)) else list(given)
        out["targets"] = list(self.targets)
        out["stack"] = None if self.stack is None else list(self.stack)
        out["bias"] = self.bias_policy
        mode = get_mode(self.mode)
        # a number or "A:B"; not given: None, where the mode mixes (t = 1), else the mode's own default, 1
        out["strength"] = self.strength.recorded() if self.strength is not None else (None if mode.mixes else 1.0)
        for owner in all_modes():
            for given in owner.parameters:
                if given.always_recorded:
                    out[given.name] = given.resolved(out[given.name]) if owner is mode else None
                elif out[given.name] is None:  # only where set: records of the other modes stay as they were
                    del out[given.name]
        return out


def _stacks(spec: str | Iterable[str]) -> tuple[str, ...]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return tuple(s.strip() for s in items if s.strip())


MAX_STEPS = 64  # steps in a recipe: beyond any real schedule of resets
RECIPE_METHOD = "recipe"  # the record's method of a recipe of several steps (each step names its own)


@dataclass(frozen=True)
class Recipe:
    """Several re-initializations of one checkpoint, applied in order in one pass over its bytes: each tensor is
    read once, every step that touches it changes it in turn (a later step reads what the earlier ones left), and
    it is written once. Each step is a :class:`ReinitOptions` (its own selection, mode and strength); a recipe of
    one step is that step's run, byte for byte.

    Read from a file by ``surgeon.plan.planner.read_recipe`` (TOML ``[[step]]`` tables or YAML ``steps:``), written
    back by :meth:`to_toml` (``surgeon inspect --emit-recipe``)."""

    steps: tuple[ReinitOptions, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if not 0 < len(self.steps) <= MAX_STEPS:
            raise OptionError(f"a recipe holds 1 to {MAX_STEPS} steps, not {len(self.steps)}")
        if not all(isinstance(s, ReinitOptions) for s in self.steps):
            raise TypeError("the steps of a Recipe are surgeon.ReinitOptions")

    @classmethod
    def from_data(cls, data: Any, where: str) -> Recipe:
        """A recipe from a parsed file: ``{"step": [...]}`` (TOML's ``[[step]]``) or ``{"steps": [...]}``, each step
        a table of options by their flag's name (``layers``, ``keep-scale``, ``from``, ...) or their keyword.

        Raises:
            OptionError: Not a list of steps, an option no step takes, or a value an option refuses (named with its
                step).
        """
        steps = data.get("steps", data.get("step")) if isinstance(data, dict) else None
        if not isinstance(data, dict) or set(data) - {"step", "steps"} or not isinstance(steps, list) or not steps:
            raise OptionError(
                f"{where} is not a recipe: give a list of steps ([[step]] tables in TOML, steps: in YAML)"
            )
        names = {shell_name(f.name): f.name for f in fields(ReinitOptions)}
        read = []
        for i, step in enumerate(steps[: MAX_STEPS + 1], 1):
            if not isinstance(step, dict):
                raise OptionError(f"{where}: step {i} is not a table of options")
            unknown = [k for k in step if shell_name(str(k)) not in names]
            if unknown:
                raise OptionError(
                    f"{where}: step {i} has an option surgeon does not know ({unknown[0]!r}): the options are "
                    + ", ".join(sorted(names))
                )
            given = {names[shell_name(str(k))]: v for k, v in step.items()}
            for name, info in option_infos():  # a spec as the command line gives it, so the record is the CLI's
                value = given.get(name)
                if info.spec and isinstance(value, (int, list)) and not isinstance(value, bool):
                    given[name] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            try:
                read.append(ReinitOptions.build(**given))
            except SurgeonError as exc:
                exc.context = f"{where}: step {i}: {exc.context or ''}"
                raise
        return cls(tuple(read))

    def to_toml(self, notes: dict[int, str] | None = None) -> str:
        """The recipe as a TOML file: one ``[[step]]`` table per step, each with the options a reproduce command
        spells (those that apply to its mode), by their flag's name; ``notes``: a comment above a step."""
        lines = []
        for i, step in enumerate(self.steps):
            options = step.to_dict()
            note = (notes or {}).get(i)
            lines += ([""] if i else []) + ([f"# {line}" for line in note.splitlines()] if note else []) + ["[[step]]"]
            for name, info in option_infos():
                value = options.get(name)
                if value is None or (info.recorded is not None and not info.recorded(options)):
                    continue
                lines.append(f"{shell_name(name)} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def shell_name(name: str) -> str:
    """An option as a recipe file names it: its flag without the dashes (``keep-scale``, ``from``)."""
    return name.rstrip("_").replace("_", "-")


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a basic string: JSON's escapes are TOML's
