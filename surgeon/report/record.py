"""surgeon's record in an output, read as hostile input: every field type-checked before it is used.

A record is what ``Plan.record()`` wrote: ``tool``, ``version``, ``method``, ``options`` (the fields of
``ReinitOptions.to_dict()``), ``blocks`` (one entry per re-initialized block) and, in ONNX outputs,
``copies`` (shared initializer -> the copy the chosen projections read), ``layout`` (the layout file the blocks
were read with) and ``origin`` (the Hub model and commit it was read from). Anything else, a missing key,
a wrong type or a value surgeon never writes is a one-line :class:`CheckpointError` (exit 1), never a
traceback. Where the record was written by another surgeon version, the message says so first: that
version's records (and draws) may differ from this one's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import CheckpointError, SurgeonError, VerificationError
from ..files.bounded import CARD_LIMIT, loads, read_text
from ..modes import Parameter, all_modes, get_mode, parameters
from ..modes.base import parse_strength
from ..open.hub_ids import parse_repo_id
from ..options import BIAS_CHOICES, MAX_STEPS, MODES, RECIPE_METHOD, Recipe, ReinitOptions
from ..vocab.spectrum import VALUE_IDENTITIES
from .card import CARD_CLOSE, CARD_OPEN

if TYPE_CHECKING:
    from ..open.source import Source

MAX_LIST = 1_000_000  # entries in any list of a record (blocks, layer/head numbers): beyond any real model
MAX_TEXT = 100_000  # characters in any string of a record


@dataclass(frozen=True)
class RecordStep:
    """One run's part of a record (a recipe has one per step): its options as surgeon reads them, the blocks it
    re-initialized and its SOURCE (a restore), as stored."""

    options: ReinitOptions
    blocks: list
    source: dict | None = None


@dataclass(frozen=True)
class Record:
    """A type-checked record: ``raw`` as stored, the options as surgeon reads them (a recipe's: its first step's,
    every step in ``steps``)."""

    raw: dict
    version: str
    options: ReinitOptions
    blocks: list
    copies: dict[str, str]
    steps: tuple[RecordStep, ...] = ()  # a recipe of several steps, in order

    @property
    def runs(self) -> tuple[RecordStep, ...]:
        """Every run the record holds: a recipe's steps, or the one run."""
        return self.steps or (RecordStep(self.options, self.blocks, self.source),)

    @property
    def recipe(self) -> Recipe | None:
        """The recipe a recipe's record holds (None for a single run)."""
        return Recipe(tuple(step.options for step in self.steps)) if self.steps else None

    @property
    def origin(self) -> tuple[str, str] | None:
        """The Hub model and commit the output was made from (checked when parsed), if it was made from one."""
        found = self.raw.get("origin")
        return (found["repo"], found["commit"]) if found else None

    @property
    def source(self) -> dict | None:
        """SOURCE, as a restore recorded it (checked when parsed): ``{"repo", "commit"}`` or ``{"sha256": {...}}``."""
        return self.raw.get("from")

    @property
    def other_version(self) -> bool:
        return self.version != __version__


def other_version_note(version: str) -> str:
    return (
        f"it was made by surgeon {version}, and this is surgeon {__version__}, whose records and draws may differ "
        f"from {version}'s: verify it with surgeon {version}"
    )


def parse_json(text: str, where: str) -> Any:
    """JSON from a file someone else wrote: any failure (bad syntax, nesting too deep, a number too long) is one line."""
    return loads(text, where=f"{where}: surgeon's record")


def history(value: Any, where: str) -> list:
    """The list of records kept under the ``surgeon`` key (oldest first); a lone record is a list of one."""
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list) or not value:
        raise CheckpointError(
            f"{where}: surgeon's record is {_kind(value)}, not a list of records: it was not written by surgeon"
        )
    if len(value) > MAX_LIST:
        raise CheckpointError(f"{where}: surgeon's record holds {len(value)} records: it was not written by surgeon")
    return value


def card_records(text: str) -> list[dict]:
    """Every record in a model card, in the order they appear. surgeon writes one, the output's own: the records
    a source's card carries (earlier runs, or forged ones) are escaped in it (surgeon.report.card.inert)."""
    found, pos = [], 0
    while (start := text.find(CARD_OPEN, pos)) >= 0:
        end = text.find(CARD_CLOSE, start + len(CARD_OPEN))
        if end < 0:
            break
        body = text[start + len(CARD_OPEN) : end]
        if body.startswith("{") and body.endswith("}"):
            found.append(parse_json(body, "the model card"))
        pos = end + len(CARD_CLOSE)
    return found


def read_card(path: Path) -> list[dict]:
    """The records in the model card ``path``; a card too large or unreadable is one line."""
    return card_records(read_text(path, what="model card", limit=CARD_LIMIT))


def only_record(found: list[dict], where: str) -> dict | None:
    """The one record of a model card (None: it holds none). Several: the card was changed after surgeon wrote it,
    as surgeon writes one, and which one speaks for the output cannot be told (a VerificationError)."""
    if len(found) > 1:
        raise VerificationError(
            f"{where} holds {len(found)} surgeon records, and surgeon writes one (the output's own, a source card's "
            "escaped): the card was changed after surgeon wrote it"
        )
    return found[0] if found else None


def read_card_record(path: Path) -> dict | None:
    """The one record of the model card ``path`` (:func:`only_record`)."""
    return only_record(read_card(path), f"the model card {path}")


def parse_record(value: Any, where: str) -> Record:
    """The last record of an output, type-checked; a one-line CheckpointError for anything surgeon never writes."""
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{where}: the last surgeon record is {_kind(value)}, not a record: it was not written by surgeon"
        )
    version = value.get("version")
    if not isinstance(version, str) or not 0 < len(version) <= 64 or not version.isprintable():
        raise CheckpointError(
            f"{where}: the last surgeon record has no readable version ({_show(version)}): it was not written by surgeon"
        )
    try:
        return _parse(value, version, where)
    except CheckpointError as exc:
        if version == __version__:
            raise
        raise CheckpointError(
            f"{where}: {other_version_note(version)} (this version cannot read its record: {str(exc.args[0]).removeprefix(where + ': ')})"
        ) from None


# Records of surgeon 0.2.0 and older say this for every mode; since then each mode names its own method.
LEGACY_METHOD = "conditioned-initialization"
_TOP: dict[str, type] = {
    "tool": str,
    "version": str,
    "method": str,
    "options": dict,
    "blocks": list,
    "copies": dict,
    "layout": dict,
    "origin": dict,
    "from": dict,
    "steps": list,
}
_REQUIRED = ("tool", "version", "method", "options", "blocks")
_REQUIRED_RECIPE = ("tool", "version", "method", "steps")


def _parse(value: dict, version: str, where: str) -> Record:
    recipe = value.get("method") == RECIPE_METHOD
    bad = _bad_keys(value, _TOP, _REQUIRED_RECIPE if recipe else _REQUIRED)
    if not bad and recipe and ({"options", "blocks", "from"} & set(value)):
        bad = f"has {sorted({'options', 'blocks', 'from'} & set(value))[0]!r} beside its steps"
    if not bad and not recipe and "steps" in value:
        bad = "has 'steps' for a single run"
    if bad:
        raise CheckpointError(f"{where}: the last surgeon record {bad}")
    methods = {m.method for m in all_modes()} | {LEGACY_METHOD, RECIPE_METHOD}
    if value["tool"] != "surgeon" or value["method"] not in methods:
        raise CheckpointError(
            f"{where}: the last surgeon record names tool {_show(value['tool'])}, method {_show(value['method'])}: not surgeon's"
        )
    if recipe:
        found = value["steps"]
        if not 1 < len(found) <= MAX_STEPS:
            raise CheckpointError(
                f"{where}: the last surgeon record holds a recipe of {len(found)} steps: not surgeon's"
            )
        steps = tuple(
            _step(step, f"{where}: step {i} of the last surgeon record", where, alone=True)
            for i, step in enumerate(found)
        )
    else:
        steps = (_step(value, f"{where}: the last surgeon record", where, alone=False),)
    copies = value.get("copies", {})
    if not all(isinstance(k, str) and isinstance(v, str) and _text(k) and _text(v) for k, v in copies.items()):
        raise CheckpointError(f"{where}: the last surgeon record's copies are not initializer names")
    layout = value.get("layout")
    if layout is not None and not (
        set(layout) == {"file", "sha256"}
        and isinstance(layout["file"], str)
        and _text(layout["file"])
        and isinstance(layout["sha256"], str)
        and re.fullmatch("[0-9a-f]{64}", layout["sha256"])
    ):
        raise CheckpointError(f"{where}: the last surgeon record's layout is not a layout file's name and sha256")
    origin = value.get("origin")
    if origin is not None and not (
        set(origin) == {"repo", "commit"}
        and isinstance(origin["repo"], str)
        and parse_repo_id(origin["repo"]) == origin["repo"]
        and isinstance(origin["commit"], str)
        and re.fullmatch("[0-9a-f]{40}", origin["commit"])
    ):
        raise CheckpointError(f"{where}: the last surgeon record's origin is not a Hub model id and a commit id")
    first = steps[0]
    return Record(value, version, first.options, first.blocks, dict(copies), steps if recipe else ())


_STEP: dict[str, type] = {"method": str, "options": dict, "blocks": list, "from": dict}


def _step(value: Any, label: str, where: str, *, alone: bool) -> RecordStep:
    """One run's method, options, blocks and SOURCE, checked (``label``: the record, or a recipe's step of it, with
    ``where`` first; ``alone``: a recipe's step holds nothing else)."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{label} is {_kind(value)}, not a record")
    bad = _bad_keys({k: v for k, v in value.items() if k in _STEP}, _STEP, ("method", "options", "blocks"))
    extra = [k for k in value if k not in _STEP] if alone else []
    if bad or extra:
        raise CheckpointError(f"{label} {bad or f'has a field surgeon does not write ({_show(extra[0])})'}")
    options = parse_options(value["options"], where)
    if value["method"] not in (get_mode(options.mode).method, LEGACY_METHOD):
        raise CheckpointError(f"{label} says method {_show(value['method'])} for mode {options.mode}: not surgeon's")
    blocks = value["blocks"]
    for i, block in enumerate(blocks[: MAX_LIST + 1]):
        problem = _block_problem(block) if i < MAX_LIST else "is one too many"
        if problem:
            raise CheckpointError(f"{where}: block {i} of {label.removeprefix(where + ': ')} {problem}")
    source = value.get("from")
    if source is not None and not (_hub_commit(source) or _digests(source)):
        raise CheckpointError(f"{label}'s SOURCE is neither a Hub model id and a commit id nor files' sha256")
    if (source is not None) != get_mode(options.mode).reference:
        named = "names" if source is not None else "does not name"
        raise CheckpointError(f"{label} {named} a SOURCE for mode {options.mode}: not surgeon's")
    return RecordStep(options, blocks, source)


def _hub_commit(value: dict) -> bool:
    """``{"repo": ..., "commit": ...}``: a Hub model id and a commit id."""
    return (
        set(value) == {"repo", "commit"}
        and isinstance(value["repo"], str)
        and parse_repo_id(value["repo"]) == value["repo"]
        and isinstance(value["commit"], str)
        and re.fullmatch("[0-9a-f]{40}", value["commit"]) is not None
    )


def _digests(value: dict) -> bool:
    """``{"sha256": {file: digest}}``: the weight files of a checkpoint on disk, each by its sha256."""
    files = value.get("sha256")
    return (
        set(value) == {"sha256"}
        and isinstance(files, dict)
        and 0 < len(files) <= MAX_LIST
        and all(
            isinstance(k, str) and _text(k) and isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v)
            for k, v in files.items()
        )
    )


def _text(s: str) -> bool:
    return 0 < len(s) <= MAX_TEXT


def _spec(v: Any) -> bool:
    """A layer or head selection as ReinitOptions.to_dict writes it: a spec string, one number or a list of numbers."""
    if isinstance(
        v, str
    ):  # a number of 19 digits or more is no layer or head (and int() of thousands of digits raises)
        return len(v) <= MAX_TEXT and not re.search(r"\d{19}", v)
    if v is None:
        return True
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) < 2**31
    return (
        isinstance(v, list)
        and len(v) <= MAX_LIST
        and all(isinstance(i, int) and not isinstance(i, bool) and abs(i) < 2**31 for i in v)
    )


def _choice(v: Any, choices: tuple[str, ...]) -> bool:
    return isinstance(v, str) and v in choices


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_OPTIONS: dict[str, Any] = {
    "layers": _spec,
    "heads": _spec,
    "targets": lambda v: (
        isinstance(v, list)
        and 0 < len(v) <= 3
        and all(_choice(t, ("q", "k", "v")) for t in v)
        and len(set(v)) == len(v)
    ),
    "attention": lambda v: _choice(v, ("self", "cross", "all")),
    "stack": lambda v: (
        v is None or (isinstance(v, list) and len(v) <= MAX_LIST and all(isinstance(s, str) and _text(s) for s in v))
    ),
    "mode": lambda v: _choice(v, MODES),
    "strength": lambda v: v is None or _strength(v),
    "value_identity": lambda v: _choice(v, VALUE_IDENTITIES),
    "keep_scale": lambda v: isinstance(v, bool),
    "bias": lambda v: _choice(v, BIAS_CHOICES),
    "seed": lambda v: isinstance(v, int) and not isinstance(v, bool),
    # each mode's own parameters, as their modes declare them
    **{p.name: (lambda v, p=p: _parameter_ok(p, v)) for p in parameters()},
}


def _strength(v: Any) -> bool:
    """A strength as ReinitOptions.to_dict writes it: a number in (0, 1], or "A:B"."""
    if not (_number(v) or (isinstance(v, str) and len(v) <= 64)):
        return False
    try:
        parse_strength(v)
    except SurgeonError:
        return False
    return True


def _parameter_ok(declared: Parameter, v: Any) -> bool:
    """A mode parameter as its mode records it: in its range, and None only where it is always recorded."""
    if v is None:
        return declared.always_recorded
    if declared.kind is str:
        return isinstance(v, str) and _text(v) and declared.problem(v) is None
    return _number(v) and declared.problem(v) is None


# recorded only where set (the others are always recorded)
_WHERE_SET = tuple(p.name for p in parameters() if not p.always_recorded)


def parse_options(options: dict, where: str) -> ReinitOptions:
    bad = _bad_keys(options, {k: object for k in _OPTIONS}, tuple(k for k in _OPTIONS if k not in _WHERE_SET))
    if bad:
        raise CheckpointError(f"{where}: the options of the last surgeon record: {bad}")
    for key, ok in _OPTIONS.items():
        if key in options and not ok(options[key]):
            raise CheckpointError(
                f"{where}: the last surgeon record's option {key} is {_show(options[key])}, a value surgeon never records"
            )
    try:
        return ReinitOptions(**options)
    except SurgeonError as exc:
        raise CheckpointError(f"{where}: the last surgeon record's options cannot be used ({exc})") from None


def _bad_keys(value: dict, types: dict[str, type], required: tuple[str, ...]) -> str | None:
    missing = [k for k in required if k not in value]
    if missing:
        return f"has no {missing[0]!r}"
    unknown = [k for k in value if k not in types]
    if unknown:
        return f"has a field surgeon does not write ({_show(unknown[0])})"
    for k, t in types.items():
        if k in value and not isinstance(value[k], t):
            return f"has {k!r} as {_kind(value[k])}, not {t.__name__}"
    return None


def _block_problem(block: Any) -> str | None:
    if not isinstance(block, dict):
        return f"is {_kind(block)}, not a block"
    fields = {"module": str, "stack": str, "layer": object, "kind": str, "targets": dict, "shared_layers": list}
    bad = _bad_keys(block, fields, ("module", "stack", "layer", "kind", "targets"))
    if bad:
        return bad
    layer = block["layer"]
    if layer is not None and not _index(layer):
        return f"has layer {_show(layer)}"
    shared = block.get("shared_layers", [])
    if len(shared) > MAX_LIST or not all(_index(i) for i in shared):
        return f"has shared layers {_show(shared)}"
    if not all(_choice(r, ("q", "k", "v")) and isinstance(h, str) and _text(h) for r, h in block["targets"].items()):
        return "has targets surgeon never records"
    return None


def _index(v: Any) -> bool:
    """A layer number as surgeon records it."""
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**31


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def stored_history(source: Source) -> tuple[list | None, str]:
    """surgeon's records stored in an opened checkpoint (oldest first; None: none stored), and where they are.

    Formats with a record slot (safetensors ``__metadata__``, ONNX ``metadata_props``): the entry ``surgeon`` of
    their files, one at most per file, the longest history (the last run's); formats without one (PyTorch
    files): the model card README.md of a folder, its own record."""
    weights = source.primary
    if weights.record_slot:
        where = f"its {weights.format} metadata"
        found: list | None = None
        for (
            file,
            texts,
        ) in (
            weights.record_texts()
        ):  # in place, a record goes only where a header has room: the longest is the last run's
            label = f"{weights.folder / file} ({where})"
            if len(texts) > 1:
                raise CheckpointError(
                    f"{weights.folder / file}: its {weights.format} metadata entries hold {len(texts)} surgeon records "
                    "where surgeon writes one"
                )
            records = history(parse_json(texts[0], label), label) if texts else None
            if records is not None and (found is None or len(records) > len(found)):
                found = records
        return found, where
    card = source.folder / "README.md"
    if source.kind == "folder" and card.is_file():
        own = read_card_record(card)
        return ([own] if own is not None else None), f"the model card {card}"
    return None, "the file (PyTorch files have no metadata slot)"
